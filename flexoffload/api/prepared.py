"""A Prepared: a request as the user gave it, and what api.prepare decided for it (the file run, the budget in bytes,
the plan, the engine's settings, the drafting, the notes). It crosses to an enforced run's child as JSON, and to
`run --plan DIR` as the plan's files with run.json beside them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from flexoffload import FlexoffloadError, options
from flexoffload.gguf.model import Model, load
from flexoffload.plan import plans
from flexoffload.runtime import engine
from flexoffload.speculation import tree as spectree

DECISION_FILE = "run.json"  # beside a plan's files: the Prepared `plan -o` wrote (drafting, ubatch, tree, ...)


@dataclass(frozen=True)
class Prepared:
    """A request ready to load: the request as given, and what was decided for it."""
    request: options.Request  # as the user gave it
    model: Model  # the file run (a precision plan's or a sparsity level's file, or the one named)
    limit: int | None  # the budget in bytes
    plan: plans.Plan | None  # None: mmap, or every weight resident
    settings: engine.Settings  # what the runtime loads by
    draft: str | None = None  # a resident draft model's path
    draft_bytes: int = 0  # what the draft and the free drafters' tables take out of the budget
    free: tuple[str, ...] = ()  # the free drafters run
    tree: spectree.Options | None = None  # set where the run speculates
    store: str | None = None  # where Token Recycling's table outlives the run
    decode_tok_s: float = 0.0  # decode's predicted speed with resident_after_prefill (0: the plan's)
    notes: list[str] = field(default_factory=list)  # what the caller should tell the user (stderr)
    mmap_plan: plans.Plan | None = None  # where mmap was chosen over a plan: that choice as a plan (policy mmap)

    @property
    def strategy(self) -> str:
        return self.settings.strategy

    @property
    def spec_type(self) -> str:
        """The speculation run, as --spec-type names it ("none": the target alone)."""
        return ",".join((["model"] if self.draft else []) + list(self.free)) or "none"

    def to_json(self) -> str:
        """The Prepared for a child process: everything it needs to run without preparing again."""
        return json.dumps({"request": asdict(self.request), "model": str(self.model.path), "limit": self.limit,
                           "plan": self.plan.to_dict() if self.plan else None, "settings": asdict(self.settings),
                           "draft": self.draft, "draft_bytes": self.draft_bytes, "free": list(self.free),
                           "tree": asdict(self.tree) if self.tree else None, "store": self.store,
                           "decode_tok_s": self.decode_tok_s, "notes": self.notes,
                           "mmap_plan": self.mmap_plan.to_dict() if self.mmap_plan else None})

    @classmethod
    def from_json(cls, text: str) -> "Prepared":
        d = json.loads(text)
        settings = {f.name: d["settings"][f.name] for f in fields(engine.Settings) if f.name in d["settings"]}
        for name, value in settings.items():  # JSON has lists where Settings has tuples
            if isinstance(value, list):
                settings[name] = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        return cls(options.Request(**d["request"]), load(d["model"]), d["limit"],
                   plans.Plan.from_dict(d["plan"]) if d["plan"] else None, engine.Settings(**settings), d["draft"],
                   d["draft_bytes"], tuple(d["free"]), spectree.Options(**d["tree"]) if d["tree"] else None,
                   d["store"], d["decode_tok_s"], d["notes"],
                   plans.Plan.from_dict(d["mmap_plan"]) if d.get("mmap_plan") else None)

    def write(self, directory) -> Path:
        """The plan's files (tensors.ot, plan.json) and, beside them, this whole Prepared as JSON (run.json: the
        drafting and the history it used, the ubatch, the settings, the tuned choice and the precision file in the
        plan): `run --plan DIRECTORY` runs what this Prepared would (mmap chosen at this budget: a plan of policy
        mmap)."""
        plan = self.plan or self.mmap_plan
        if plan is None:
            raise FlexoffloadError("without a budget every weight stays resident: there is no plan to write (give "
                                   "--mem)")
        directory = plans.write(plan, directory)
        (directory / DECISION_FILE).write_text(json.dumps(json.loads(self.to_json()), indent=1) + "\n")
        return directory
