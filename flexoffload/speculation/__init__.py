"""Speculation: a draft proposes, the target verifies, and a controller decides the next tree from what the run
measured (three roles, three places, as vLLM's spec_decode and llama.cpp's common/speculative lay it out).

- drafters.py   the drafters that need no model in memory (n-grams of the context, Token Recycling), merged
- tree.py       the token tree, pure: nodes, branches, the walk, LLMCad's pacer and thresholds, the run's counts
- grow.py       drafting a tree: the draft model's steps (by the controller or LLMCad's rules), the free drafters'
- verify.py     the target's pass over a tree, the walk down what it accepts, what the drafters are told
- control.py    the measured decision: acceptance by depth, the pass's costs, how deep, whether the draft drafts
- history.py    what runs of a model pair measured, kept between runs by prompt kind
- kvcache.py    both models' KV bookkeeping around a tree
- state.py      what one speculating call keeps between its steps
- settings.py   what speculation asks of the two contexts, and the node budgets that size them
- speculate.py  the Speculator: a call's loop over the parts above, and the entry points (run, converse)

What is decided before loading (whether to spend memory on a draft, which one) is prepare's drafting step,
api/drafting.py, which plans and measures and so sits above this package.
"""
