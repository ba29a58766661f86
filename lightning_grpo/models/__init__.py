"""The policy and its tokenizer: the embedded SmolLM2-135M-Instruct (``embedded``), loading and saving
(``loading``), LoRA adapters (``lora``), and tiny random models for tests (``testing``)."""
