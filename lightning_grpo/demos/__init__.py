"""Tiny random models for tests, benchmarks and recipes (Lightning keeps such helpers in
``lightning.pytorch.demos``): Llamas and a reward model with a real tokenizer cut small (``tiny_models``), and
vision-language checkpoints built from configs with local processors (``tiny_vision_models``). Never models to
train for real; nothing in the rest of the package imports them."""
