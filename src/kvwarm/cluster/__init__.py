"""kvwarm on Ray Serve: N engine replicas behind one OpenAI ingress and a prefix-affinity router.

Layout (docs/architecture.md, "Cluster"): ``chains`` and ``routing`` are pure (no Ray); ``calls``
holds the typed requests the ingress sends and the router reads; ``replica`` is the engine
deployment, ``remote`` and ``ingress`` the ingress side, ``router`` the Ray ``RequestRouter``,
``deploy`` starts Ray and runs the application. Nothing outside this package imports Ray.
"""
