"""How many predicted neuron groups a token reads (--sparsity; M2Cache's dynamic sparsity, issue 31): the data
`profile --neurons` measures (measure/sparsity.py) and the choice of a level under a quality bound."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from flexoffload import FlexoffloadError
from flexoffload.plan.mixed import DEFAULT_MAX_KLD


@dataclass(frozen=True)
class Level:
    """One k: a token reads the hot set and k predicted groups of each layer's FFN."""
    n_used: int
    ffn_share: float  # of the FFN's neurons a token reads
    read_share: float  # of the dense file's weights a token reads
    kld: float  # against the dense file, on held-out text
    kld_err: float
    ppl: float
    ppl_dense: float
    same_top: float  # how often the top token is the dense file's
    mass: float  # held-out calibration tokens: the share of the FFN's output mass read (means over the layers)
    best_mass: float  # the same for the best k groups (the predictor's bound)
    recall: float  # of the best k groups, the share the predictor chose


@dataclass(frozen=True)
class Sparsity:
    """A dense model's grouped file and its measured levels (what `profile --neurons` reports)."""
    model: str  # the dense file
    file: str  # the grouped file, every group used (moefy.with_used makes a level's)
    n_group: int
    group_width: int  # neurons a group
    n_hot: int
    levels: list[Level] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Sparsity":
        return cls(**{**d, "levels": [Level(**x) for x in d["levels"]]})


def parse(value: str | None) -> int | str | None:
    """--sparsity: auto, or the groups a token reads (a whole number); None: dense."""
    if value is None or value == "auto":
        return value
    try:
        k = int(value)
    except ValueError:
        k = 0
    if k < 1:
        raise FlexoffloadError(f"--sparsity takes auto or the groups a token reads (a whole number), not {value}")
    return k


def choose(s: Sparsity, max_kld: float | None = None) -> Level | None:
    """The fewest groups within the bound (default DEFAULT_MAX_KLD, as --precision auto's); None when only reading
    every group is (that is the dense model, re-laid out: nothing to gain)."""
    bound = DEFAULT_MAX_KLD if max_kld is None else max_kld
    fits = [x for x in s.levels if x.kld <= bound and x.n_used < s.n_group]
    return min(fits, key=lambda x: x.n_used) if fits else None
