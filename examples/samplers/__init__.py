"""Example custom samplers, usable through ``sampler: custom`` (import from the repository root).

* ``examples.samplers.curriculum.CurriculumSampler``: easy -> medium -> hard stages, random within a stage.
* ``examples.samplers.mixing.WeightedMixingSampler`` over ``examples.samplers.mixing.MixedDataset``:
  weighted mixing of several packed files, a fresh plan every epoch.
"""
