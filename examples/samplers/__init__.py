"""Example custom sampler, usable through ``sampler: custom`` (import from the repository root).

* ``examples.samplers.curriculum.CurriculumSampler``: easy -> medium -> hard stages, random within a stage.

Weighted mixing of several packed files is library code (``packsft.data.mixing``), configured with ``data.train``.
"""
