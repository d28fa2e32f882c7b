//! `libtessera_sim.so`: the simulated node's driver library. Laid out as `libnvidia-ml.so.1` and
//! `libcuda.so.1` (see `tessera-sim install`), it exports NVIDIA's NVML and CUDA driver ABIs with
//! their exact names, struct layouts and return codes, over the shared device model. Programs
//! written against NVIDIA's headers (nvml-wrapper, CUDA runtimes, our own daemon and shim) use it
//! as they would the real driver.
//!
//! Rules for every export: no panic crosses `extern "C"` (each body runs inside [`ffi::guard`]),
//! nothing runs at load time, and every pointer from the caller is checked before use.

mod cuda;
mod ffi;
mod latency;
mod nvml;
mod process;
