"""torchturbo where users already train: the Hugging Face ``Trainer`` and Lightning.

- ``torchturbo.integrations.transformers`` (``pip install 'torchturbo[transformers]'``):
  ``recipe_from_trainer``, ``training_arguments``, ``TurboCallback``, ``TurboTrainer``;
- ``torchturbo.integrations.lightning`` (``pip install 'torchturbo[lightning]'``):
  ``recipe_from_lightning``, ``trainer_kwargs``, ``TurboLightningCallback``;
- ``torchturbo.integrations.translate``: the settings themselves as plain data, which needs
  neither library (the tuner writes them next to turbo.toml).

The submodules import their library when imported, so this package imports neither.
See docs/integrations.md.
"""
