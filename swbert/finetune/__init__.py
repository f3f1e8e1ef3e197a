"""Downstream fine-tuning and evaluation: GLUE, SQuAD, embedding-noise robustness, cross-domain transfer.

The launchers (``launchers/finetune_glue.py``, ``launchers/finetune_squad.py``, ``launchers/report.py``)
parse arguments and call into these modules; the report command turns MLflow runs into the paper's
tables (1: GLUE, 2: SQuAD, 5: noise, 6: cross-domain).
"""
