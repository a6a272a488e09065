"""Running a model: loading, the Engine's prefill and decode, per-step metrics, the numeric guard."""
