"""Train an EAGLE draft head: python train.py [experiment=smoke] [overrides]; -m for sweeps.

The same as `python -m eagle_lab.train`, configured from eagle_lab/conf/train.yaml (also reachable as conf/).
"""

from eagle_lab.train import main

if __name__ == "__main__":
    main()
