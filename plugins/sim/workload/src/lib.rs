//! A CUDA workload that allocates device memory and launches kernels of a chosen duration at a
//! chosen rate, reaching the driver any of the three ways real programs do, and reports what it
//! achieved as JSON. It runs on the simulated node and on a real GPU alike: its kernel is real
//! PTX that spins on %globaltimer for the duration, and its name carries the duration for the sim.

pub mod api;

use std::ffi::{CString, c_void};
use std::time::{Duration, Instant};

use api::{CUDA_ERROR_OUT_OF_MEMORY, CudaError, Driver, Handle, Lookup};
use serde::Serialize;

/// What to do.
#[derive(Debug, Clone, clap::Args)]
pub struct Plan {
    /// How to reach the driver.
    #[arg(long, value_enum, default_value = "dlsym")]
    pub lookup: Lookup,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: i32,
    /// Device memory to allocate, in MiB.
    #[arg(long, default_value_t = 0)]
    pub alloc_mib: u64,
    /// Size of each allocation, in MiB (default: everything in one).
    #[arg(long)]
    pub chunk_mib: Option<u64>,
    /// Size of each allocation, in bytes (instead of `--chunk-mib`: many small buffers).
    #[arg(long)]
    pub chunk_bytes: Option<u64>,
    /// Write a pattern into each allocation and read it back.
    #[arg(long)]
    pub verify: bool,
    /// Duration of each kernel, in microseconds.
    #[arg(long, default_value_t = 1000)]
    pub kernel_us: u64,
    /// Every this many launches, one of `--long-us` instead (0: none). The kernels are then one
    /// function whose duration is its parameter, so that the two lengths are the same kernel.
    #[arg(long, default_value_t = 0)]
    pub long_every: u64,
    /// Duration of the long kernels of `--long-every`, in microseconds.
    #[arg(long, default_value_t = 0)]
    pub long_us: u64,
    /// Keep launching for this many seconds.
    #[arg(long, default_value_t = 0.0)]
    pub seconds: f64,
    /// Launch at most this many kernels (0: no limit but --seconds).
    #[arg(long, default_value_t = 0)]
    pub kernels: u64,
    /// Kernels per second (0: back to back, bounded by --depth).
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// Kernels in flight at most before the workload waits for the oldest.
    #[arg(long, default_value_t = 2)]
    pub depth: usize,
    /// How each launch is made: `kernel` (cuLaunchKernel), `cooperative`
    /// (cuLaunchCooperativeKernel), `ex` (cuLaunchKernelEx), `graph` (cuGraphLaunch of a graph
    /// of `--graph-kernels` kernels in a chain) or `capture` (the same graph made by capturing
    /// that many cuLaunchKernel on the stream, as PyTorch's CUDA graphs are).
    #[arg(long, value_enum, default_value = "kernel")]
    pub launch: LaunchForm,
    /// The stream launched on: `created` (cuStreamCreate), `null`, `legacy` (CU_STREAM_LEGACY)
    /// or `per-thread` (CU_STREAM_PER_THREAD).
    #[arg(long, value_enum, default_value = "created")]
    pub stream: StreamKind,
    /// Kernels in each graph of `--launch graph`.
    #[arg(long, default_value_t = 100)]
    pub graph_kernels: u64,
    /// After the work, hold the memory this many seconds (for tests that look or kill).
    #[arg(long, default_value_t = 0.0)]
    pub hold: f64,
    /// Export the first allocation for other processes (cuIpcGetMemHandle), as a program that
    /// shares its memory by CUDA IPC does: such memory cannot cross a checkpoint.
    #[arg(long)]
    pub ipc_export: bool,
}

/// Which stream kernels are launched on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StreamKind {
    Created,
    Null,
    Legacy,
    PerThread,
}

/// How kernels are launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LaunchForm {
    Kernel,
    Cooperative,
    Ex,
    Graph,
    Capture,
}

/// What happened, printed as JSON.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub lookup: String,
    pub pid: u32,
    pub driver_version: i32,
    pub device: i32,
    pub device_name: String,
    pub device_total_bytes: u64,
    pub mem_total: u64,
    pub mem_free_before: u64,
    pub mem_free_after_alloc: u64,
    pub requested_bytes: u64,
    pub allocated_bytes: u64,
    pub allocations: u64,
    pub alloc_error: Option<String>,
    pub verified_bytes: u64,
    /// With `--verify` and `--hold`: bytes read back again after the hold, equal to the pattern
    /// (a program parked and resumed while it held them keeps its data).
    pub verified_after_hold_bytes: u64,
    /// With `--ipc-export`: the bytes of the allocation exported.
    pub ipc_exported_bytes: u64,
    pub kernels: u64,
    pub kernel_us: u64,
    /// Kernel time the GPU spent for us: kernels x duration.
    pub kernel_time_ms: f64,
    /// First launch to last completion, by CUDA events.
    pub gpu_span_ms: f64,
    pub wall_ms: f64,
    /// kernel_time / wall: the share of a GPU the workload got.
    pub achieved_share: f64,
    /// The rate the workload's kernels were let through at: the GPU time of every kernel but the
    /// last over the time from the first launch's return to the last one's. Under a share that
    /// holds kernels back, their own launch times pace them; unlike `achieved_share`, no edge
    /// of the run weighs (a 30% share with 500 ms kernels over 10 s: 7 kernels in 10.5 s, 0.333;
    /// 6 kernels let through in 10 s, 0.300).
    pub launch_share: f64,
    pub error: Option<CudaError>,
}

/// The kernel: spin on the global nanosecond timer for `ns`, named so the simulator knows too.
fn ptx(name: &str) -> String {
    format!(
        ".version 7.0\n.target sm_70\n.address_size 64\n\
         .visible .entry {name}(.param .u64 ns)\n{{\n\
         .reg .u64 %t0, %t1, %d, %n;\n.reg .pred %p;\n\
         ld.param.u64 %n, [ns];\nmov.u64 %t0, %globaltimer;\n\
         SPIN:\nmov.u64 %t1, %globaltimer;\nsub.u64 %d, %t1, %t0;\n\
         setp.lt.u64 %p, %d, %n;\n@%p bra SPIN;\nret;\n}}\n\0"
    )
}

/// Runs the plan on a driver table; errors end the run but are reported, not lost.
pub fn run(cu: &Driver, plan: &Plan) -> Report {
    let mut r = Report {
        lookup: format!("{:?}", plan.lookup).to_lowercase(),
        pid: std::process::id(),
        device: plan.device,
        kernel_us: plan.kernel_us,
        requested_bytes: plan.alloc_mib << 20,
        ..Report::default()
    };
    let start = Instant::now();
    if let Err(e) = work(cu, plan, &mut r) {
        r.error = Some(e);
    }
    r.wall_ms = start.elapsed().as_secs_f64() * 1e3;
    r
}

fn work(cu: &Driver, plan: &Plan, r: &mut Report) -> Result<(), CudaError> {
    // SAFETY: in all driver calls below, every pointer passed is a valid out-pointer or buffer of
    // the size given, and every handle was returned by the driver and is still alive.
    unsafe {
        cu.check("cuInit", (cu.init)(0))?;
        cu.check("cuDriverGetVersion", (cu.driver_get_version)(&mut r.driver_version))?;
        let mut dev = 0;
        cu.check("cuDeviceGet", (cu.device_get)(&mut dev, plan.device))?;
        let mut name = [0i8; 256];
        cu.check("cuDeviceGetName", (cu.device_get_name)(name.as_mut_ptr(), name.len() as i32, dev))?;
        r.device_name = std::ffi::CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
        let mut total = 0usize;
        cu.check("cuDeviceTotalMem", (cu.device_total_mem)(&mut total, dev))?;
        r.device_total_bytes = total as u64;
        let mut ctx: Handle = std::ptr::null_mut();
        cu.check("cuDevicePrimaryCtxRetain", (cu.primary_ctx_retain)(&mut ctx, dev))?;
        cu.check("cuCtxSetCurrent", (cu.ctx_set_current)(ctx))?;
        let (mut free, mut total) = (0usize, 0usize);
        cu.check("cuMemGetInfo", (cu.mem_get_info)(&mut free, &mut total))?;
        r.mem_free_before = free as u64;
        r.mem_total = total as u64;

        let mut ptrs = Vec::new();
        let chunk = plan.chunk_bytes.unwrap_or(plan.chunk_mib.unwrap_or(plan.alloc_mib).max(1) << 20).max(1);
        let mut left = r.requested_bytes;
        while left > 0 {
            let n = chunk.min(left);
            let mut p = 0u64;
            let rc = (cu.mem_alloc)(&mut p, n as usize);
            if rc == CUDA_ERROR_OUT_OF_MEMORY {
                r.alloc_error = Some(cu.error_name(rc));
                break;
            }
            cu.check("cuMemAlloc", rc)?;
            ptrs.push((p, n));
            r.allocated_bytes += n;
            r.allocations += 1;
            left -= n;
        }
        cu.check("cuMemGetInfo", (cu.mem_get_info)(&mut free, &mut total))?;
        r.mem_free_after_alloc = free as u64;
        if plan.verify {
            for &(p, n) in &ptrs {
                let len = n.min(1 << 20) as usize;
                let pattern: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
                cu.check("cuMemsetD8", (cu.memset_d8)(p, 0xab, n as usize))?;
                cu.check("cuMemcpyHtoD", (cu.memcpy_htod)(p, pattern.as_ptr().cast(), len))?;
                let mut back = vec![0u8; len];
                cu.check("cuMemcpyDtoH", (cu.memcpy_dtoh)(back.as_mut_ptr().cast(), p, len))?;
                if back != pattern {
                    return Err(CudaError { call: "verify".into(), code: -1, name: "read back differs".into() });
                }
                r.verified_bytes += len as u64;
            }
        }

        if plan.ipc_export
            && let Some(&(p, n)) = ptrs.first()
        {
            let mut handle = api::IpcMemHandle { reserved: [0; 64] };
            cu.check("cuIpcGetMemHandle", (cu.ipc_get_mem_handle)(&mut handle, p))?;
            r.ipc_exported_bytes = n;
        }
        if plan.seconds > 0.0 || plan.kernels > 0 {
            launch_loop(cu, plan, r)?;
        }
        if plan.hold > 0.0 {
            println!("{}", serde_json::json!({ "holding": r.allocated_bytes, "pid": r.pid }));
            std::thread::sleep(Duration::from_secs_f64(plan.hold));
            if plan.verify {
                for &(p, n) in &ptrs {
                    let len = n.min(1 << 20) as usize;
                    let pattern: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
                    let mut back = vec![0u8; len];
                    cu.check("cuMemcpyDtoH", (cu.memcpy_dtoh)(back.as_mut_ptr().cast(), p, len))?;
                    if back != pattern {
                        return Err(CudaError {
                            call: "verify".into(),
                            code: -1,
                            name: "read back differs after the hold".into(),
                        });
                    }
                    r.verified_after_hold_bytes += len as u64;
                }
            }
        }
        for (p, _) in ptrs {
            cu.check("cuMemFree", (cu.mem_free)(p))?;
        }
        cu.check("cuDevicePrimaryCtxRelease", (cu.primary_ctx_release)(dev))?;
    }
    Ok(())
}

fn launch_loop(cu: &Driver, plan: &Plan, r: &mut Report) -> Result<(), CudaError> {
    // One function for both lengths when they mix: its duration is its parameter (the simulator
    // reads it too, by the `_argns` name).
    let name = match plan.long_every {
        0 => format!("tessera_spin_{}us", plan.kernel_us),
        _ => "tessera_spin_argns".to_string(),
    };
    let image = ptx(&name);
    let cname = CString::new(name).expect("no NUL");
    // SAFETY: as in `work`: valid out-pointers, live handles, a NUL-terminated image.
    unsafe {
        let mut module: Handle = std::ptr::null_mut();
        cu.check("cuModuleLoadData", (cu.module_load_data)(&mut module, image.as_ptr().cast()))?;
        let mut func: Handle = std::ptr::null_mut();
        cu.check("cuModuleGetFunction", (cu.module_get_function)(&mut func, module, cname.as_ptr()))?;
        let mut stream: Handle = std::ptr::null_mut();
        match plan.stream {
            StreamKind::Created => cu.check("cuStreamCreate", (cu.stream_create)(&mut stream, 0))?,
            // The default streams by their handles: NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD.
            StreamKind::Null => {}
            StreamKind::Legacy => stream = 1 as Handle,
            StreamKind::PerThread => stream = 2 as Handle,
        }
        // One event per slot of the in-flight window, plus the first-launch marker.
        let depth = plan.depth.max(1);
        let mut events: Vec<Handle> = vec![std::ptr::null_mut(); depth];
        for e in &mut events {
            cu.check("cuEventCreate", (cu.event_create)(e, 0))?;
        }
        let mut first: Handle = std::ptr::null_mut();
        cu.check("cuEventCreate", (cu.event_create)(&mut first, 0))?;
        cu.check("cuEventRecord", (cu.event_record)(first, stream))?;
        let mut ns: u64 = 0;
        let mut params = [(&mut ns as *mut u64).cast::<c_void>()];
        // A graph of `graph_kernels` kernels in a chain, each of `kernel_us` (the function's
        // name tells the simulator; the parameter tells a real GPU).
        let mut graph_ns: u64 = plan.kernel_us * 1000;
        let mut graph_params = [(&mut graph_ns as *mut u64).cast::<c_void>()];
        let (mut graph, mut exec): (Handle, Handle) = (std::ptr::null_mut(), std::ptr::null_mut());
        if plan.launch == LaunchForm::Graph {
            cu.check("cuGraphCreate", (cu.graph_create)(&mut graph, 0))?;
            let mut prev: Handle = std::ptr::null_mut();
            for _ in 0..plan.graph_kernels.max(1) {
                let p = api::KernelNodeParams {
                    func,
                    grid: [1, 1, 1],
                    block: [32, 1, 1],
                    shared_mem_bytes: 0,
                    kernel_params: graph_params.as_mut_ptr(),
                    extra: std::ptr::null_mut(),
                    kern: std::ptr::null_mut(),
                    ctx: std::ptr::null_mut(),
                };
                let mut node: Handle = std::ptr::null_mut();
                let deps = usize::from(!prev.is_null());
                cu.check("cuGraphAddKernelNode", (cu.graph_add_kernel_node)(&mut node, graph, &prev, deps, &p))?;
                prev = node;
            }
            cu.check("cuGraphInstantiateWithFlags", (cu.graph_instantiate)(&mut exec, graph, 0))?;
        }
        if plan.launch == LaunchForm::Capture {
            // Mode 1: CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, as PyTorch captures.
            cu.check("cuStreamBeginCapture", (cu.stream_begin_capture)(stream, 1))?;
            for _ in 0..plan.graph_kernels.max(1) {
                let p = graph_params.as_mut_ptr();
                cu.check(
                    "cuLaunchKernel (captured)",
                    (cu.launch_kernel)(func, 1, 1, 1, 32, 1, 1, 0, stream, p, std::ptr::null_mut()),
                )?;
            }
            cu.check("cuStreamEndCapture", (cu.stream_end_capture)(stream, &mut graph))?;
            cu.check("cuGraphInstantiateWithFlags", (cu.graph_instantiate)(&mut exec, graph, 0))?;
        }
        let graphed = matches!(plan.launch, LaunchForm::Graph | LaunchForm::Capture);
        let per_launch = if graphed { plan.graph_kernels.max(1) } else { 1 };
        let begin = Instant::now();
        let deadline = (plan.seconds > 0.0).then(|| begin + Duration::from_secs_f64(plan.seconds));
        let mut launched = 0u64;
        let mut kernel_ns = 0u64;
        // (first launch's return, last launch's return, kernel time before the last launch).
        let mut paced: Option<(Instant, Instant, u64)> = None;
        loop {
            if plan.kernels > 0 && launched >= plan.kernels {
                break;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            if plan.rate > 0.0 {
                let due = begin + Duration::from_secs_f64(launched as f64 / plan.rate);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
            let long = plan.long_every > 0 && launched % plan.long_every == plan.long_every - 1;
            let this_ns = if long { plan.long_us } else { plan.kernel_us } * 1000 * per_launch;
            // The parameter, through the pointer the launch reads it by (the driver copies it).
            params[0].cast::<u64>().write(this_ns);
            let before = kernel_ns;
            kernel_ns += this_ns;
            let slot = (launched % depth as u64) as usize;
            if launched >= depth as u64 {
                cu.check("cuEventSynchronize", (cu.event_synchronize)(events[slot]))?;
            }
            let p = params.as_mut_ptr();
            match plan.launch {
                LaunchForm::Kernel => cu.check(
                    "cuLaunchKernel",
                    (cu.launch_kernel)(func, 1, 1, 1, 32, 1, 1, 0, stream, p, std::ptr::null_mut()),
                )?,
                LaunchForm::Cooperative => cu.check(
                    "cuLaunchCooperativeKernel",
                    (cu.launch_cooperative_kernel)(func, 1, 1, 1, 32, 1, 1, 0, stream, p),
                )?,
                LaunchForm::Ex => {
                    let config = api::LaunchConfig {
                        grid: [1, 1, 1],
                        block: [32, 1, 1],
                        shared_mem_bytes: 0,
                        stream,
                        attrs: std::ptr::null_mut(),
                        num_attrs: 0,
                    };
                    cu.check("cuLaunchKernelEx", (cu.launch_kernel_ex)(&config, func, p, std::ptr::null_mut()))?
                }
                LaunchForm::Graph | LaunchForm::Capture => {
                    cu.check("cuGraphLaunch", (cu.graph_launch)(exec, stream))?
                }
            }
            let now = Instant::now();
            paced = Some(paced.map_or((now, now, 0), |(first, _, _)| (first, now, before)));
            cu.check("cuEventRecord", (cu.event_record)(events[slot], stream))?;
            launched += 1;
        }
        cu.check("cuStreamSynchronize", (cu.stream_synchronize)(stream))?;
        r.kernels = launched;
        r.kernel_time_ms = kernel_ns as f64 / 1e6;
        if launched > 0 {
            let last = events[((launched - 1) % depth as u64) as usize];
            let mut ms = 0f32;
            cu.check("cuEventElapsedTime", (cu.event_elapsed_time)(&mut ms, first, last))?;
            r.gpu_span_ms = f64::from(ms);
        }
        let wall = begin.elapsed().as_secs_f64() * 1e3;
        r.achieved_share = if wall > 0.0 { r.kernel_time_ms / wall } else { 0.0 };
        if let Some((first, last, before_last)) = paced {
            let span = last.duration_since(first).as_secs_f64();
            r.launch_share = if span > 0.0 { before_last as f64 / 1e9 / span } else { 0.0 };
        }
        if !exec.is_null() {
            cu.check("cuGraphExecDestroy", (cu.graph_exec_destroy)(exec))?;
            cu.check("cuGraphDestroy", (cu.graph_destroy)(graph))?;
        }
        for e in events.into_iter().chain([first]) {
            cu.check("cuEventDestroy", (cu.event_destroy)(e))?;
        }
        if plan.stream == StreamKind::Created {
            cu.check("cuStreamDestroy", (cu.stream_destroy)(stream))?;
        }
        cu.check("cuModuleUnload", (cu.module_unload)(module))?;
    }
    Ok(())
}

/// Prints the report and turns it into the exit code: 0 all done, 3 allocation ran out of
/// memory, 1 any other driver error.
pub fn finish(r: &Report) -> std::process::ExitCode {
    println!("{}", serde_json::to_string(r).expect("report serializes"));
    if r.error.is_some() {
        std::process::ExitCode::from(1)
    } else if r.alloc_error.is_some() {
        std::process::ExitCode::from(3)
    } else {
        std::process::ExitCode::SUCCESS
    }
}
