"""The engine: one model, two computation paths, no RL.

Data flow: ``model`` (the one forward) -> ``rollout`` (KV-cache ``generate``: the rollout path, with
``sampling``'s counter-based sampler) and ``scoring`` (full-sequence ``token_logprobs``: the training path).
``inputs`` validates and pads what users pass in. Imports only ``vexact_kernels`` (the folder ``kernels/``).
"""
