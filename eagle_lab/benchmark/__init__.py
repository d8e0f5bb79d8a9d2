"""Benchmarking (`python serve.py mode=bench`): run.py times every method on the same prompts
(prompt_sets.py: MT-bench, HumanEval or a JSONL file) and report.py writes the results table and plot;
sweep.py drives the batched server at several concurrencies (`bench.concurrency=[...]`), and
profile_round.py (`python -m eagle_lab.benchmark.profile_round`) shows where one round's time goes.
"""
