"""The generate-then-train fit loop (``fit_loop``), its experience fetcher (``fetcher``), the rollout schedule and the
``LoopPlan`` the module hands the loop (``schedule``), the fetcher's place in the epoch (``cursor``) and what an exact
resume needs (``resume``)."""
