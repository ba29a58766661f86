"""Unmodified agents as rollouts (``GRPOModule(agent=fn)``, docs/agents.md): the :class:`AgentSampler`
(``agent_sampler``), the agent gateway's HTTP layer (``gateway``) and its OpenAI request body (``openai_schema``),
the sessions that own the tokenization (``session``), a sampled turn as an OpenAI message (``answer``), the calls
batched into the engine (``batcher``) and the episodes as a rollout (``output``). An agent's chat request stays in
this folder, but for the HTTP guards it shares with the rollout server (``LimitBody``, ``is_loopback``)."""
