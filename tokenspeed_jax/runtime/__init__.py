"""The device side: `runner.ModelRunner` owns the params and the device state and runs the
jitted step (`shapes` picks each step's token / kv bucket, `step_inputs` packs StepOps into two
buffers, `state` holds the page pools, `sampling` the penalties and samplers, `backends` picks
the kernels, `sharding` and `param_sources` place weights on a mesh, `compile_cache` persists
compiled shapes across starts). Modules import jax; this package file does not."""
