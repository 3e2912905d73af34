"""The executors behind the engine (runtime/executor_api.py): `xla` runs an artifact's exported
programs through jax; `h100` replays its kernel schedule through the CUDA driver (`scheduled`
walks the schedule; `cuda_driver`, `tma` talk to the driver)."""
