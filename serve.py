"""Generate with a target LLM and an EAGLE draft head: python serve.py prompt="..." [overrides].

The same as `python -m eagle_lab.serve`: generation, the bench (mode=bench) and the HTTP server
(mode=server), configured from eagle_lab/conf/serve.yaml (also reachable as conf/).
"""

from eagle_lab.serve import main

if __name__ == "__main__":
    main()
