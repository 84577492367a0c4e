"""Real checkpoints and users' own stacks: ``pretrained`` (Hugging Face Llama/Mistral/Qwen checkpoints as a
vexact ``Transformer``; their config and files read and checked by ``hf_config`` and ``hf_checkpoint``),
``measure`` (natural mismatch between two computation paths) and ``check`` (the bitwise guarantee on this machine).
Imports ``vexact.engine``, ``vexact.rl`` (metrics, run files) and below."""
