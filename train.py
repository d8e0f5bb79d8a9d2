"""Train an EAGLE draft head: python train.py [experiment=smoke] [overrides]; -m for sweeps."""

import hydra
from omegaconf import DictConfig

from eagle_lab.cli import run_entry
from eagle_lab.config import register_configs

register_configs()


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from eagle_lab.trainer import run

    run_entry(run, cfg)


if __name__ == "__main__":
    main()
