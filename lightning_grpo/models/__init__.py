"""The policy and its tokenizer: the embedded SmolLM2-135M-Instruct (``embedded``), loading and saving
(``loading``), LoRA adapters (``lora``). Tiny random models for tests are :mod:`lightning_grpo.demos`."""
