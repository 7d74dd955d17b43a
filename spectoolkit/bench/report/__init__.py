"""The run report: loading a run, sections, checklist, interpretation, plots."""
