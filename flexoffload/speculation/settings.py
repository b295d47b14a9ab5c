"""What speculation asks of the two models' contexts: the settings it refuses (check_settings), the target's
context for trees (target_settings), the draft's resident one (draft_settings, draft_by_rows), and the node budgets
that size them (FREE_NODES, FREE_NODES_MAX, RPC_NODES).

Apart from speculate.py because they are decided before anything is loaded: the API sizes a run's memory and its
trees from them (api/drafting.py), and the Speculator checks against them what llama.cpp made.
"""

from __future__ import annotations

from dataclasses import replace

from flexoffload import FlexoffloadError
from flexoffload.gguf.model import Model
from flexoffload.plan.costmodel import looked_up_only
from flexoffload.plan.plans import override_patterns
from flexoffload.plan.planners import is_small
from flexoffload.speculation.tree import MAX_BRANCHES, MAX_NODES, Options

FREE_NODES = 16  # free drafters' node budget where neither --draft-max nor the cost of a node is known
FREE_NODES_MAX = 32  # and where the cost of a node is known (chosen by it): the target's logits rows
# Tensors on an RPC server are computed in the server's process, whose kernels set_tiled_matmul (patch 0009) cannot
# switch from here: it takes the tiled K-quant kernels from 8 tokens a pass, which round otherwise than one-token
# passes (the 1.5B's logits up to 0.6 apart with 4 layers there). Passes of 7 nodes stay on its per-row kernels.
RPC_NODES = 7
# why a tree is verified with flash attention where a server computes attention (the options' rule and the checks
# here say it alike)
FLASH_ATTN_OFF = ("without flash attention a server computes attention's matmuls for a pass of 2 or more tokens with "
                  "llamafile's sgemm and for one token with vec_dot, which round differently (the 1.5B's logits 0.62 "
                  "apart); this process turns sgemm off for its own passes (patch 0023), not a server's")
# the refusals check_settings guards, written once: rules.py's rules "spec-rpc-flash" and "spec-rows" refuse them first
RPC_FLASH_REFUSED = "speculation with --rpc verifies its trees with flash attention: not with -fa off"
ROWS_REFUSED = "speculation (-md, --spec-type) verifies trees of 2 tokens or more a pass: -b and -ub at least 2"


def check_settings(settings) -> None:
    """Refuse settings under which verifying a tree could not give the target's own output: flash attention off
    where another device computes attention (FLASH_ATTN_OFF; llama.cpp's auto turns it off where a layer's attention
    would run on another device, known once the context is made: the Speculator refuses that), or a ubatch of one
    token (a tree needs two or more a pass). On the CPU a pass computes attention's matmuls row by row as a
    one-token pass does (patch 0023: sgemm follows the switch verification turns off)."""
    if settings.flash_attn == "off" and settings.rpc:
        raise FlexoffloadError(RPC_FLASH_REFUSED)
    if settings.n_ubatch == 1 or settings.n_batch < 2:
        raise FlexoffloadError(ROWS_REFUSED)


def free_nodes(options: Options) -> int:
    """The rows a target keeps for free drafters alone (each row is n_vocab floats of logits)."""
    return FREE_NODES_MAX if options.node_s > 0 else FREE_NODES


def target_settings(settings, max_nodes: int | None = None):
    """The target's context: a logits row per tree node, a sequence per branch and one for rejected cells. Its
    compute buffers stay the prefill's (decode_ubatch off: a tree pass needs more than one token's), and so do the
    streamed tensors (resident_after_prefill: that is decode_ubatch's memory)."""
    return replace(settings, n_outputs=max(max_nodes or MAX_NODES, MAX_BRANCHES + 1), n_seq_max=MAX_BRANCHES + 1,
                   decode_ubatch=0, resident_after_prefill=())


def draft_by_rows(draft: Model) -> list[str]:
    """The draft's tensors read by rows, not kept: a token_embd used only for lookups (the draft has an output
    matrix of its own) costs one small read a draft token, and its memory goes to the target (89 MiB of the
    0.5B Qwen's 537). A token_embd the output is tied to stays: the output's matmul reads all of it every step."""
    return [t.name for t in draft.tensors if looked_up_only(draft, t) and not is_small(t)]


def draft_settings(settings, draft: Model):
    """The draft's: every tensor read once into memory but those read by rows (draft_by_rows); one output per
    step, but llama.cpp reserves at least one per sequence. On this machine: the target's placement on RPC servers
    (its tensors' names, its layers) is not the draft's."""
    patterns = override_patterns(draft_by_rows(draft), [t.name for t in draft.tensors])
    return replace(settings, strategy="stream", streamed_patterns=tuple(patterns), n_outputs=MAX_BRANCHES,
                   n_seq_max=MAX_BRANCHES, decode_ubatch=0, resident_after_prefill=(), rpc=(), n_gpu_layers=0,
                   tensor_split=(), placed_patterns=())
