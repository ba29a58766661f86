"""The generate-then-train fit loop (``fit_loop``), its experience fetcher (``fetcher``) and what an exact resume
needs (``resume``)."""
