"""`python train.py` / `python -m eagle_lab.train`: compose the training config, run the recipe."""

import functools

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from eagle_lab.config import register_configs
from eagle_lab.drafters.card import reproducing_command
from eagle_lab.errors import run_entry
from eagle_lab.training.trainer import run

register_configs()


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    command = reproducing_command("train.py", list(HydraConfig.get().overrides.task))
    run_entry(functools.partial(run, command=command), cfg)


if __name__ == "__main__":
    main()
