"""The Hydra configs (serve.yaml, train.yaml and their groups), shipped with the package."""
