"""Generate with a target LLM and an EAGLE draft head: python serve.py prompt="..." [overrides].

This file is only the Hydra entry point (config composition from conf/serve.yaml); what it runs,
generation, the bench (mode=bench) and the HTTP server (mode=server), is eagle_lab/serve.py.
"""

import hydra
from omegaconf import DictConfig

from eagle_lab.cli import run_entry
from eagle_lab.config import register_configs

register_configs()


@hydra.main(config_path="conf", config_name="serve", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from eagle_lab.serve import run

    run_entry(run, cfg)


if __name__ == "__main__":
    main()
