//! `nvmlDeviceResetGpu`: what `nvidia-smi --gpu-reset` does on a real node, here the model's
//! reset (the same as `tessera-sim reset`): back on the bus, volatile ECC counts cleared, a
//! pending MIG mode applied, every context on the GPU destroyed.

use super::*;

nvml_guarded_exports! {
    /// `nvmlDeviceResetGpu`: resets a physical GPU (a MIG device handle is `INVALID_ARGUMENT`).
    fn nvmlDeviceResetGpu(device) {
        let node = node()?;
        let gpu = handles::physical_gpu(node, device)?;
        node.reset(gpu).map_err(|e| code(&e))
    }
}
