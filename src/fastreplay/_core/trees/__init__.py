"""Priority segment trees: one interface, two backends (pure torch, compiled numba loops).

``interface`` (:class:`~fastreplay._core.trees.interface.PriorityTreeBackend`, the factory),
``torch_backend``, ``numba_backend`` (with its compiled loops in ``numba_kernels``), ``ops``
(the checked writes and sampling both backends share) and ``views`` (read-only views that
answer like TorchRL's compiled trees).
"""
