"""Training-side computation: experience records and their micro-batches (``experience``, ``packing``), the
forward layouts of completion logprobs (``logprobs``), step metrics (``metrics``), step-level token selections
(``selection``), the non-finite guard (``nonfinite``) and the optimizer (``optim``)."""
