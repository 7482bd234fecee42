"""What a run leaves on disk and reads back: checkpoints (`checkpoint`), LoRA's frozen base and
its record (`frozen_base`), the workdir's records and lock (`workdir`), a run's policy read back
(`policy`), and export of a run to a PEFT / Hugging Face directory (`export`).

It imports the learner (a checkpoint is a `TrainState`), `models`, `parallel` and `validation`;
only `run/` and the command line entry points import it.
"""
