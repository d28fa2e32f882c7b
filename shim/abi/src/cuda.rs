//! The CUDA driver table: every `cuda.h` function Tessera defines (the simulated driver's exports,
//! the shim's hooks) or calls (the shim's table of the real library), with CUDA 12.8's types from
//! `cudarc::driver::sys`. Enum parameters are raw integers (`c_int`/`c_uint`), and caller structs
//! whose enum fields are read are taken through the raw-integer mirrors of [`raw`], so no value a
//! C caller passes is an invalid Rust enum. Rows are grouped by subject; a second name on a row is
//! the function's per-thread-default-stream twin (`_ptsz`, `_ptds`: the same signature); every
//! function returns `CUresult` unless its row says otherwise.

#![allow(non_snake_case)] // parameter and function names are cuda.h's

pub use std::ffi::{c_char, c_int, c_uchar, c_uint, c_ulonglong, c_ushort, c_void};

pub use cudarc::driver::sys;
pub use sys::CUresult;

pub use raw::{Array3dDescV1, ArrayDescV1, MemLocation, Memcpy2dV1};

/// Caller structs as C lays them out, their enum fields read as the raw integers C stored.
pub mod raw {
    use super::{c_int, c_uint, c_void, sys};

    /// `CUDA_ARRAY_DESCRIPTOR` (v2: `size_t` sizes).
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct ArrayDesc {
        pub width: usize,
        pub height: usize,
        pub format: c_uint,
        pub channels: c_uint,
    }

    /// `CUDA_ARRAY3D_DESCRIPTOR` (v2).
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct Array3dDesc {
        pub width: usize,
        pub height: usize,
        pub depth: usize,
        pub format: c_uint,
        pub channels: c_uint,
        pub flags: c_uint,
    }

    /// `CUDA_ARRAY_DESCRIPTOR_v1` (legacy 32-bit sizes).
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct ArrayDescV1 {
        pub width: c_uint,
        pub height: c_uint,
        pub format: c_uint,
        pub channels: c_uint,
    }

    /// `CUDA_ARRAY3D_DESCRIPTOR_v1`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct Array3dDescV1 {
        pub width: c_uint,
        pub height: c_uint,
        pub depth: c_uint,
        pub format: c_uint,
        pub channels: c_uint,
        pub flags: c_uint,
    }

    /// `CUDA_MEMCPY2D_v1` (legacy 32-bit fields).
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct Memcpy2dV1 {
        pub src_x: c_uint,
        pub src_y: c_uint,
        pub src_type: u32,
        pub src_host: *const c_void,
        pub src_device: c_uint,
        pub src_array: sys::CUarray,
        pub src_pitch: c_uint,
        pub dst_x: c_uint,
        pub dst_y: c_uint,
        pub dst_type: u32,
        pub dst_host: *mut c_void,
        pub dst_device: c_uint,
        pub dst_array: sys::CUarray,
        pub dst_pitch: c_uint,
        pub width: c_uint,
        pub height: c_uint,
    }

    /// `CUmemLocation` passed by value, its type read as the raw integer C passed.
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct MemLocation {
        pub type_: u32,
        pub id: c_int,
    }

    // The legacy structs have no binding; their sizes are the header's (4-byte fields, and
    // Memcpy2dV1's pointers aligned to 8).
    const _: () = assert!(size_of::<ArrayDescV1>() == 16 && size_of::<Array3dDescV1>() == 24);
    const _: () = assert!(size_of::<Memcpy2dV1>() == 96);
    const _: () = assert!(size_of::<MemLocation>() == size_of::<sys::CUmemLocation>());
    const _: () = assert!(size_of::<ArrayDesc>() == size_of::<sys::CUDA_ARRAY_DESCRIPTOR>());
    const _: () = assert!(size_of::<Array3dDesc>() == size_of::<sys::CUDA_ARRAY3D_DESCRIPTOR>());
    const _: () =
        assert!(std::mem::offset_of!(Array3dDesc, flags) == std::mem::offset_of!(sys::CUDA_ARRAY3D_DESCRIPTOR, Flags));
}

table! {
    CUresult;

    // Contexts (primary and created), limits, the context stack.
    fn cuCtxCreate_v2(pctx: *mut sys::CUcontext, flags: c_uint, dev: c_int);
    fn cuCtxCreate(pctx: *mut sys::CUcontext, flags: c_uint, dev: c_int);
    fn cuCtxCreate_v3(pctx: *mut sys::CUcontext, paramsArray: *mut sys::CUexecAffinityParam, numParams: c_int, flags: c_uint, dev: c_int);
    fn cuCtxCreate_v4(pctx: *mut sys::CUcontext, ctxCreateParams: *mut sys::CUctxCreateParams, flags: c_uint, dev: c_int);
    fn cuCtxDestroy_v2(ctx: sys::CUcontext);
    fn cuCtxDestroy(ctx: sys::CUcontext);
    fn cuCtxPushCurrent_v2(ctx: sys::CUcontext);
    fn cuCtxPushCurrent(ctx: sys::CUcontext);
    fn cuCtxPopCurrent_v2(pctx: *mut sys::CUcontext);
    fn cuCtxPopCurrent(pctx: *mut sys::CUcontext);
    fn cuCtxSetCurrent(ctx: sys::CUcontext);
    fn cuCtxGetCurrent(pctx: *mut sys::CUcontext);
    fn cuCtxGetDevice(device: *mut c_int);
    fn cuCtxSynchronize();
    fn cuCtxGetApiVersion(ctx: sys::CUcontext, version: *mut c_uint);
    fn cuCtxGetId(ctx: sys::CUcontext, ctxId: *mut c_ulonglong);
    fn cuCtxGetLimit(pvalue: *mut usize, limit: c_int);
    fn cuCtxSetLimit(limit: c_int, value: usize);
    fn cuCtxGetFlags(flags: *mut c_uint);
    fn cuCtxSetFlags(flags: c_uint);
    fn cuCtxGetStreamPriorityRange(leastPriority: *mut c_int, greatestPriority: *mut c_int);
    fn cuCtxGetCacheConfig(pconfig: *mut c_int);
    fn cuCtxSetCacheConfig(config: c_int);
    fn cuCtxResetPersistingL2Cache();
    fn cuCtxEnablePeerAccess(peerContext: sys::CUcontext, Flags: c_uint);
    fn cuCtxDisablePeerAccess(peerContext: sys::CUcontext);
    fn cuDevicePrimaryCtxRetain(pctx: *mut sys::CUcontext, dev: c_int);
    fn cuDevicePrimaryCtxRelease_v2(dev: c_int);
    fn cuDevicePrimaryCtxRelease(dev: c_int);
    fn cuDevicePrimaryCtxReset_v2(dev: c_int);
    fn cuDevicePrimaryCtxReset(dev: c_int);
    fn cuDevicePrimaryCtxGetState(dev: c_int, flags: *mut c_uint, active: *mut c_int);
    fn cuDevicePrimaryCtxSetFlags_v2(dev: c_int, flags: c_uint);
    fn cuDevicePrimaryCtxSetFlags(dev: c_int, flags: c_uint);
    fn cuCtxDetach(ctx: sys::CUcontext);

    // Copies and memsets.
    fn cuMemcpy(dst: sys::CUdeviceptr, src: sys::CUdeviceptr, ByteCount: usize), cuMemcpy_ptds;
    fn cuMemcpyAsync(dst: sys::CUdeviceptr, src: sys::CUdeviceptr, ByteCount: usize, hStream: sys::CUstream), cuMemcpyAsync_ptsz;
    fn cuMemcpyHtoD_v2(dstDevice: sys::CUdeviceptr, srcHost: *const c_void, ByteCount: usize), cuMemcpyHtoD_v2_ptds;
    fn cuMemcpyHtoD(dstDevice: c_uint, srcHost: *const c_void, ByteCount: c_uint);
    fn cuMemcpyHtoDAsync_v2(dstDevice: sys::CUdeviceptr, srcHost: *const c_void, ByteCount: usize, hStream: sys::CUstream), cuMemcpyHtoDAsync_v2_ptsz;
    fn cuMemcpyHtoDAsync(dstDevice: c_uint, srcHost: *const c_void, ByteCount: c_uint, hStream: sys::CUstream);
    fn cuMemcpyDtoH_v2(dstHost: *mut c_void, srcDevice: sys::CUdeviceptr, ByteCount: usize), cuMemcpyDtoH_v2_ptds;
    fn cuMemcpyDtoH(dstHost: *mut c_void, srcDevice: c_uint, ByteCount: c_uint);
    fn cuMemcpyDtoHAsync_v2(dstHost: *mut c_void, srcDevice: sys::CUdeviceptr, ByteCount: usize, hStream: sys::CUstream), cuMemcpyDtoHAsync_v2_ptsz;
    fn cuMemcpyDtoHAsync(dstHost: *mut c_void, srcDevice: c_uint, ByteCount: c_uint, hStream: sys::CUstream);
    fn cuMemcpyDtoD_v2(dstDevice: sys::CUdeviceptr, srcDevice: sys::CUdeviceptr, ByteCount: usize), cuMemcpyDtoD_v2_ptds;
    fn cuMemcpyDtoD(dstDevice: c_uint, srcDevice: c_uint, ByteCount: c_uint);
    fn cuMemcpyDtoDAsync_v2(dstDevice: sys::CUdeviceptr, srcDevice: sys::CUdeviceptr, ByteCount: usize, hStream: sys::CUstream), cuMemcpyDtoDAsync_v2_ptsz;
    fn cuMemcpyDtoDAsync(dstDevice: c_uint, srcDevice: c_uint, ByteCount: c_uint, hStream: sys::CUstream);
    fn cuMemcpyHtoA_v2(dstArray: sys::CUarray, dstOffset: usize, srcHost: *const c_void, ByteCount: usize), cuMemcpyHtoA_v2_ptds;
    fn cuMemcpyAtoH_v2(dstHost: *mut c_void, srcArray: sys::CUarray, srcOffset: usize, ByteCount: usize), cuMemcpyAtoH_v2_ptds;
    fn cuMemcpyDtoA_v2(dstArray: sys::CUarray, dstOffset: usize, srcDevice: sys::CUdeviceptr, ByteCount: usize), cuMemcpyDtoA_v2_ptds;
    fn cuMemcpyAtoD_v2(dstDevice: sys::CUdeviceptr, srcArray: sys::CUarray, srcOffset: usize, ByteCount: usize), cuMemcpyAtoD_v2_ptds;
    fn cuMemcpyAtoA_v2(dstArray: sys::CUarray, dstOffset: usize, srcArray: sys::CUarray, srcOffset: usize, ByteCount: usize), cuMemcpyAtoA_v2_ptds;
    fn cuMemcpyHtoAAsync_v2(dstArray: sys::CUarray, dstOffset: usize, srcHost: *const c_void, ByteCount: usize, hStream: sys::CUstream), cuMemcpyHtoAAsync_v2_ptsz;
    fn cuMemcpyAtoHAsync_v2(dstHost: *mut c_void, srcArray: sys::CUarray, srcOffset: usize, ByteCount: usize, hStream: sys::CUstream), cuMemcpyAtoHAsync_v2_ptsz;
    fn cuMemcpyHtoA(dstArray: sys::CUarray, dstOffset: c_uint, srcHost: *const c_void, ByteCount: c_uint);
    fn cuMemcpyAtoH(dstHost: *mut c_void, srcArray: sys::CUarray, srcOffset: c_uint, ByteCount: c_uint);
    fn cuMemcpyDtoA(dstArray: sys::CUarray, dstOffset: c_uint, srcDevice: c_uint, ByteCount: c_uint);
    fn cuMemcpyAtoD(dstDevice: c_uint, srcArray: sys::CUarray, srcOffset: c_uint, ByteCount: c_uint);
    fn cuMemcpyAtoA(dstArray: sys::CUarray, dstOffset: c_uint, srcArray: sys::CUarray, srcOffset: c_uint, ByteCount: c_uint);
    fn cuMemcpyHtoAAsync(dstArray: sys::CUarray, dstOffset: c_uint, srcHost: *const c_void, ByteCount: c_uint, hStream: sys::CUstream);
    fn cuMemcpyAtoHAsync(dstHost: *mut c_void, srcArray: sys::CUarray, srcOffset: c_uint, ByteCount: c_uint, hStream: sys::CUstream);
    fn cuMemcpyPeer(dstDevice: sys::CUdeviceptr, dstContext: sys::CUcontext, srcDevice: sys::CUdeviceptr, srcContext: sys::CUcontext, ByteCount: usize), cuMemcpyPeer_ptds;
    fn cuMemcpyPeerAsync(dstDevice: sys::CUdeviceptr, dstContext: sys::CUcontext, srcDevice: sys::CUdeviceptr, srcContext: sys::CUcontext, ByteCount: usize, hStream: sys::CUstream), cuMemcpyPeerAsync_ptsz;
    fn cuMemcpy2D_v2(pCopy: *const sys::CUDA_MEMCPY2D), cuMemcpy2D_v2_ptds;
    fn cuMemcpy2DUnaligned_v2(pCopy: *const sys::CUDA_MEMCPY2D), cuMemcpy2DUnaligned_v2_ptds;
    fn cuMemcpy2DAsync_v2(pCopy: *const sys::CUDA_MEMCPY2D, hStream: sys::CUstream), cuMemcpy2DAsync_v2_ptsz;
    fn cuMemcpy2D(pCopy: *const Memcpy2dV1);
    fn cuMemcpy2DUnaligned(pCopy: *const Memcpy2dV1);
    fn cuMemcpy2DAsync(pCopy: *const Memcpy2dV1, hStream: sys::CUstream);
    fn cuMemsetD8_v2(dstDevice: sys::CUdeviceptr, uc: c_uchar, N: usize), cuMemsetD8_v2_ptds;
    fn cuMemsetD8(dstDevice: c_uint, uc: c_uchar, N: c_uint);
    fn cuMemsetD16_v2(dstDevice: sys::CUdeviceptr, us: c_ushort, N: usize), cuMemsetD16_v2_ptds;
    fn cuMemsetD16(dstDevice: c_uint, us: c_ushort, N: c_uint);
    fn cuMemsetD32_v2(dstDevice: sys::CUdeviceptr, ui: c_uint, N: usize), cuMemsetD32_v2_ptds;
    fn cuMemsetD32(dstDevice: c_uint, ui: c_uint, N: c_uint);
    fn cuMemsetD2D8_v2(dstDevice: sys::CUdeviceptr, dstPitch: usize, uc: c_uchar, Width: usize, Height: usize), cuMemsetD2D8_v2_ptds;
    fn cuMemsetD2D16_v2(dstDevice: sys::CUdeviceptr, dstPitch: usize, us: c_ushort, Width: usize, Height: usize), cuMemsetD2D16_v2_ptds;
    fn cuMemsetD2D32_v2(dstDevice: sys::CUdeviceptr, dstPitch: usize, ui: c_uint, Width: usize, Height: usize), cuMemsetD2D32_v2_ptds;
    fn cuMemsetD2D8(dstDevice: c_uint, dstPitch: c_uint, uc: c_uchar, Width: c_uint, Height: c_uint);
    fn cuMemsetD2D16(dstDevice: c_uint, dstPitch: c_uint, us: c_ushort, Width: c_uint, Height: c_uint);
    fn cuMemsetD2D32(dstDevice: c_uint, dstPitch: c_uint, ui: c_uint, Width: c_uint, Height: c_uint);
    fn cuMemsetD8Async(dstDevice: sys::CUdeviceptr, uc: c_uchar, N: usize, hStream: sys::CUstream), cuMemsetD8Async_ptsz;
    fn cuMemsetD16Async(dstDevice: sys::CUdeviceptr, us: c_ushort, N: usize, hStream: sys::CUstream), cuMemsetD16Async_ptsz;
    fn cuMemsetD32Async(dstDevice: sys::CUdeviceptr, ui: c_uint, N: usize, hStream: sys::CUstream), cuMemsetD32Async_ptsz;
    fn cuMemsetD2D8Async(dstDevice: sys::CUdeviceptr, dstPitch: usize, uc: c_uchar, Width: usize, Height: usize, hStream: sys::CUstream), cuMemsetD2D8Async_ptsz;
    fn cuMemsetD2D16Async(dstDevice: sys::CUdeviceptr, dstPitch: usize, us: c_ushort, Width: usize, Height: usize, hStream: sys::CUstream), cuMemsetD2D16Async_ptsz;
    fn cuMemsetD2D32Async(dstDevice: sys::CUdeviceptr, dstPitch: usize, ui: c_uint, Width: usize, Height: usize, hStream: sys::CUstream), cuMemsetD2D32Async_ptsz;

    // Devices.
    fn cuDeviceGet(device: *mut c_int, ordinal: c_int);
    fn cuDeviceGetCount(count: *mut c_int);
    fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int);
    fn cuDeviceGetUuid(uuid: *mut sys::CUuuid, dev: c_int);
    fn cuDeviceGetUuid_v2(uuid: *mut sys::CUuuid, dev: c_int);
    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int);
    fn cuDeviceTotalMem(bytes: *mut c_uint, dev: c_int);
    fn cuDeviceComputeCapability(major: *mut c_int, minor: *mut c_int, dev: c_int);
    fn cuDeviceGetProperties(prop: *mut sys::CUdevprop, dev: c_int);
    fn cuDeviceGetPCIBusId(pciBusId: *mut c_char, len: c_int, dev: c_int);
    fn cuDeviceGetByPCIBusId(dev: *mut c_int, pciBusId: *const c_char);
    fn cuDeviceCanAccessPeer(canAccessPeer: *mut c_int, dev: c_int, peerDev: c_int);
    fn cuDeviceGetP2PAttribute(value: *mut c_int, attrib: c_int, srcDevice: c_int, dstDevice: c_int);
    fn cuDeviceGetExecAffinitySupport(pi: *mut c_int, type_: c_int, dev: c_int);
    fn cuDeviceGetAttribute(pi: *mut c_int, attrib: c_int, dev: c_int);

    // Error names.
    fn cuGetErrorName(error: c_uint, pStr: *mut *const c_char);
    fn cuGetErrorString(error: c_uint, pStr: *mut *const c_char);

    // Events.
    fn cuEventCreate(phEvent: *mut sys::CUevent, Flags: c_uint);
    fn cuEventRecord(hEvent: sys::CUevent, hStream: sys::CUstream), cuEventRecord_ptsz;
    fn cuEventRecordWithFlags(hEvent: sys::CUevent, hStream: sys::CUstream, flags: c_uint), cuEventRecordWithFlags_ptsz;
    fn cuEventQuery(hEvent: sys::CUevent);
    fn cuEventSynchronize(hEvent: sys::CUevent);
    fn cuEventElapsedTime(pMilliseconds: *mut f32, hStart: sys::CUevent, hEnd: sys::CUevent);
    fn cuEventElapsedTime_v2(pMilliseconds: *mut f32, hStart: sys::CUevent, hEnd: sys::CUevent);
    fn cuEventDestroy_v2(hEvent: sys::CUevent);
    fn cuEventDestroy(hEvent: sys::CUevent);
    fn cuStreamWaitEvent(hStream: sys::CUstream, hEvent: sys::CUevent, Flags: c_uint), cuStreamWaitEvent_ptsz;

    // Private export tables (CUDA runtime, cuBLAS).
    fn cuGetExportTable(ppExportTable: *mut *const c_void, pExportTableId: *const sys::CUuuid);

    // Graphs and stream capture.
    fn cuStreamBeginCapture(hStream: sys::CUstream), cuStreamBeginCapture_ptsz;
    fn cuStreamBeginCapture_v2(hStream: sys::CUstream, mode: c_uint), cuStreamBeginCapture_v2_ptsz;
    fn cuStreamEndCapture(hStream: sys::CUstream, phGraph: *mut sys::CUgraph), cuStreamEndCapture_ptsz;
    fn cuStreamIsCapturing(hStream: sys::CUstream, captureStatus: *mut c_uint), cuStreamIsCapturing_ptsz;
    fn cuStreamGetCaptureInfo(hStream: sys::CUstream, captureStatus_out: *mut c_uint, id_out: *mut c_ulonglong), cuStreamGetCaptureInfo_ptsz;
    fn cuStreamGetCaptureInfo_v2(hStream: sys::CUstream, captureStatus_out: *mut c_uint, id_out: *mut c_ulonglong, graph_out: *mut sys::CUgraph, dependencies_out: *mut *const sys::CUgraphNode, numDependencies_out: *mut usize), cuStreamGetCaptureInfo_v2_ptsz;
    fn cuStreamGetCaptureInfo_v3(hStream: sys::CUstream, captureStatus_out: *mut c_uint, id_out: *mut c_ulonglong, graph_out: *mut sys::CUgraph, dependencies_out: *mut *const sys::CUgraphNode, edgeData_out: *mut *const sys::CUgraphEdgeData, numDependencies_out: *mut usize), cuStreamGetCaptureInfo_v3_ptsz;
    fn cuThreadExchangeStreamCaptureMode(mode: *mut c_uint);
    fn cuGraphCreate(phGraph: *mut sys::CUgraph, flags: c_uint);
    fn cuGraphDestroy(hGraph: sys::CUgraph);
    fn cuGraphAddChildGraphNode(phGraphNode: *mut sys::CUgraphNode, hGraph: sys::CUgraph, dependencies: *const sys::CUgraphNode, numDependencies: usize, childGraph: sys::CUgraph);
    fn cuGraphAddNode(phGraphNode: *mut sys::CUgraphNode, hGraph: sys::CUgraph, dependencies: *const sys::CUgraphNode, numDependencies: usize, nodeParams: *mut sys::CUgraphNodeParams);
    fn cuGraphAddNode_v2(phGraphNode: *mut sys::CUgraphNode, hGraph: sys::CUgraph, dependencies: *const sys::CUgraphNode, dependencyData: *const c_void, numDependencies: usize, nodeParams: *mut sys::CUgraphNodeParams);
    fn cuGraphChildGraphNodeGetGraph(hNode: sys::CUgraphNode, phGraph: *mut sys::CUgraph);
    fn cuGraphAddKernelNode(phGraphNode: *mut sys::CUgraphNode, hGraph: sys::CUgraph, dependencies: *const sys::CUgraphNode, numDependencies: usize, nodeParams: *const sys::CUDA_KERNEL_NODE_PARAMS_v1);
    fn cuGraphAddKernelNode_v2(phGraphNode: *mut sys::CUgraphNode, hGraph: sys::CUgraph, dependencies: *const sys::CUgraphNode, numDependencies: usize, nodeParams: *const sys::CUDA_KERNEL_NODE_PARAMS_v2);
    fn cuGraphAddEmptyNode(phGraphNode: *mut sys::CUgraphNode, hGraph: sys::CUgraph, dependencies: *const sys::CUgraphNode, numDependencies: usize);
    fn cuGraphAddHostNode(phGraphNode: *mut sys::CUgraphNode, hGraph: sys::CUgraph, dependencies: *const sys::CUgraphNode, numDependencies: usize, nodeParams: *const sys::CUDA_HOST_NODE_PARAMS);
    fn cuGraphAddMemsetNode(phGraphNode: *mut sys::CUgraphNode, hGraph: sys::CUgraph, dependencies: *const sys::CUgraphNode, numDependencies: usize, memsetParams: *const sys::CUDA_MEMSET_NODE_PARAMS, _ctx: sys::CUcontext);
    fn cuGraphGetNodes(hGraph: sys::CUgraph, nodes: *mut sys::CUgraphNode, numNodes: *mut usize);
    fn cuGraphNodeGetType(hNode: sys::CUgraphNode, type_: *mut c_int);
    fn cuGraphInstantiateWithFlags(phGraphExec: *mut sys::CUgraphExec, hGraph: sys::CUgraph, flags: c_ulonglong);
    fn cuGraphInstantiate(phGraphExec: *mut sys::CUgraphExec, hGraph: sys::CUgraph, phErrorNode: *mut sys::CUgraphNode, logBuffer: *mut c_char, bufferSize: usize);
    fn cuGraphInstantiate_v2(phGraphExec: *mut sys::CUgraphExec, hGraph: sys::CUgraph, phErrorNode: *mut sys::CUgraphNode, logBuffer: *mut c_char, bufferSize: usize);
    fn cuGraphInstantiateWithParams(phGraphExec: *mut sys::CUgraphExec, hGraph: sys::CUgraph, instantiateParams: *mut sys::CUDA_GRAPH_INSTANTIATE_PARAMS), cuGraphInstantiateWithParams_ptsz;
    fn cuGraphExecDestroy(hGraphExec: sys::CUgraphExec);
    fn cuGraphLaunch(hGraphExec: sys::CUgraphExec, hStream: sys::CUstream), cuGraphLaunch_ptsz;
    fn cuGraphUpload(hGraphExec: sys::CUgraphExec, hStream: sys::CUstream), cuGraphUpload_ptsz;

    // Graph memory nodes.
    fn cuGraphAddMemAllocNode(phGraphNode: *mut sys::CUgraphNode, hGraph: sys::CUgraph, dependencies: *const sys::CUgraphNode, numDependencies: usize, nodeParams: *mut sys::CUDA_MEM_ALLOC_NODE_PARAMS);
    fn cuGraphAddMemFreeNode(phGraphNode: *mut sys::CUgraphNode, hGraph: sys::CUgraph, dependencies: *const sys::CUgraphNode, numDependencies: usize, dptr: sys::CUdeviceptr);
    fn cuGraphMemAllocNodeGetParams(hNode: sys::CUgraphNode, params_out: *mut sys::CUDA_MEM_ALLOC_NODE_PARAMS);
    fn cuGraphMemFreeNodeGetParams(hNode: sys::CUgraphNode, dptr_out: *mut sys::CUdeviceptr);
    fn cuDeviceGetGraphMemAttribute(device: sys::CUdevice, attr: c_int, value: *mut c_void);
    fn cuDeviceSetGraphMemAttribute(device: sys::CUdevice, attr: c_int, value: *mut c_void);
    fn cuDeviceGraphMemTrim(device: sys::CUdevice);

    // Initialization and the driver version.
    fn cuInit(Flags: c_uint);
    fn cuDriverGetVersion(driverVersion: *mut c_int);

    // Inter-process memory handles.
    fn cuIpcGetMemHandle(pHandle: *mut sys::CUipcMemHandle, dptr: sys::CUdeviceptr);
    fn cuIpcOpenMemHandle_v2(pdptr: *mut sys::CUdeviceptr, handle: sys::CUipcMemHandle, Flags: c_uint);
    fn cuIpcOpenMemHandle(pdptr: *mut sys::CUdeviceptr, handle: sys::CUipcMemHandle, Flags: c_uint);
    fn cuIpcCloseMemHandle(dptr: sys::CUdeviceptr);

    // Launches.
    fn cuLaunchKernel(f: sys::CUfunction, gridDimX: c_uint, gridDimY: c_uint, gridDimZ: c_uint, blockDimX: c_uint, blockDimY: c_uint, blockDimZ: c_uint, sharedMemBytes: c_uint, hStream: sys::CUstream, kernelParams: *mut *mut c_void, extra: *mut *mut c_void), cuLaunchKernel_ptsz;
    fn cuLaunchCooperativeKernel(f: sys::CUfunction, gridDimX: c_uint, gridDimY: c_uint, gridDimZ: c_uint, blockDimX: c_uint, blockDimY: c_uint, blockDimZ: c_uint, sharedMemBytes: c_uint, hStream: sys::CUstream, kernelParams: *mut *mut c_void), cuLaunchCooperativeKernel_ptsz;
    fn cuLaunchKernelEx(config: *const sys::CUlaunchConfig, f: sys::CUfunction, kernelParams: *mut *mut c_void, extra: *mut *mut c_void), cuLaunchKernelEx_ptsz;
    fn cuLaunchHostFunc(hStream: sys::CUstream, fn_: sys::CUhostFn, userData: *mut c_void), cuLaunchHostFunc_ptsz;

    // JIT linking.
    fn cuLinkCreate_v2(_numOptions: c_uint, _options: *mut c_int, _optionValues: *mut *mut c_void, stateOut: *mut sys::CUlinkState);
    fn cuLinkCreate(numOptions: c_uint, options: *mut c_int, optionValues: *mut *mut c_void, stateOut: *mut sys::CUlinkState);
    fn cuLinkAddData_v2(state: sys::CUlinkState, type_: c_int, data: *mut c_void, size: usize, _name: *const c_char, _numOptions: c_uint, _options: *mut c_int, _optionValues: *mut *mut c_void);
    fn cuLinkAddData(state: sys::CUlinkState, type_: c_int, data: *mut c_void, size: usize, name: *const c_char, numOptions: c_uint, options: *mut c_int, optionValues: *mut *mut c_void);
    fn cuLinkAddFile_v2(state: sys::CUlinkState, type_: c_int, path: *const c_char, _numOptions: c_uint, _options: *mut c_int, _optionValues: *mut *mut c_void);
    fn cuLinkAddFile(state: sys::CUlinkState, type_: c_int, path: *const c_char, numOptions: c_uint, options: *mut c_int, optionValues: *mut *mut c_void);
    fn cuLinkComplete(state: sys::CUlinkState, cubinOut: *mut *mut c_void, sizeOut: *mut usize);
    fn cuLinkDestroy(state: sys::CUlinkState);

    // Memory: allocation, host memory, pointer queries, arrays.
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize);
    fn cuMemGetInfo(free: *mut c_uint, total: *mut c_uint);
    fn cuMemAlloc_v2(dptr: *mut sys::CUdeviceptr, bytesize: usize);
    fn cuMemAlloc(dptr: *mut c_uint, bytesize: c_uint);
    fn cuMemAllocPitch_v2(dptr: *mut sys::CUdeviceptr, pPitch: *mut usize, WidthInBytes: usize, Height: usize, ElementSizeBytes: c_uint);
    fn cuMemAllocPitch(dptr: *mut c_uint, pPitch: *mut c_uint, WidthInBytes: c_uint, Height: c_uint, ElementSizeBytes: c_uint);
    fn cuMemAllocManaged(dptr: *mut sys::CUdeviceptr, bytesize: usize, flags: c_uint);
    fn cuMemFree_v2(dptr: sys::CUdeviceptr);
    fn cuMemFree(dptr: c_uint);
    fn cuMemGetAddressRange_v2(pbase: *mut sys::CUdeviceptr, psize: *mut usize, dptr: sys::CUdeviceptr);
    fn cuMemGetAddressRange(pbase: *mut c_uint, psize: *mut c_uint, dptr: c_uint);
    fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytesize: usize);
    fn cuMemAllocHost(pp: *mut *mut c_void, bytesize: c_uint);
    fn cuMemHostAlloc(pp: *mut *mut c_void, bytesize: usize, Flags: c_uint);
    fn cuMemFreeHost(p: *mut c_void);
    fn cuMemHostGetDevicePointer_v2(pdptr: *mut sys::CUdeviceptr, p: *mut c_void, Flags: c_uint);
    fn cuMemHostGetDevicePointer(pdptr: *mut c_uint, p: *mut c_void, Flags: c_uint);
    fn cuMemHostGetFlags(pFlags: *mut c_uint, p: *mut c_void);
    fn cuMemHostRegister_v2(p: *mut c_void, bytesize: usize, Flags: c_uint);
    fn cuMemHostRegister(p: *mut c_void, bytesize: usize, Flags: c_uint);
    fn cuMemHostUnregister(p: *mut c_void);
    fn cuPointerGetAttribute(data: *mut c_void, attribute: c_int, ptr: sys::CUdeviceptr);
    fn cuPointerGetAttributes(numAttributes: c_uint, attributes: *mut c_int, data: *mut *mut c_void, ptr: sys::CUdeviceptr);
    fn cuPointerSetAttribute(value: *const c_void, attribute: c_int, ptr: sys::CUdeviceptr);
    fn cuMemPrefetchAsync(devPtr: sys::CUdeviceptr, count: usize, dstDevice: c_int, hStream: sys::CUstream), cuMemPrefetchAsync_ptsz;
    fn cuMemAdvise(devPtr: sys::CUdeviceptr, count: usize, advice: c_int, device: c_int);
    fn cuMemPrefetchAsync_v2(devPtr: sys::CUdeviceptr, count: usize, location: MemLocation, flags: c_uint, hStream: sys::CUstream), cuMemPrefetchAsync_v2_ptsz;
    fn cuMemAdvise_v2(devPtr: sys::CUdeviceptr, count: usize, advice: c_int, location: MemLocation);
    fn cuArrayCreate_v2(pHandle: *mut sys::CUarray, pAllocateArray: *const sys::CUDA_ARRAY_DESCRIPTOR);
    fn cuArrayCreate(pHandle: *mut sys::CUarray, pAllocateArray: *const ArrayDescV1);
    fn cuArray3DCreate_v2(pHandle: *mut sys::CUarray, pAllocateArray: *const sys::CUDA_ARRAY3D_DESCRIPTOR);
    fn cuArray3DCreate(pHandle: *mut sys::CUarray, pAllocateArray: *const Array3dDescV1);
    fn cuArrayGetDescriptor_v2(pArrayDescriptor: *mut sys::CUDA_ARRAY_DESCRIPTOR, hArray: sys::CUarray);
    fn cuArrayGetDescriptor(pArrayDescriptor: *mut ArrayDescV1, hArray: sys::CUarray);
    fn cuArray3DGetDescriptor_v2(pArrayDescriptor: *mut sys::CUDA_ARRAY3D_DESCRIPTOR, hArray: sys::CUarray);
    fn cuArray3DGetDescriptor(pArrayDescriptor: *mut Array3dDescV1, hArray: sys::CUarray);
    fn cuArrayDestroy(hArray: sys::CUarray);

    // Mipmapped arrays.
    fn cuMipmappedArrayCreate(pHandle: *mut sys::CUmipmappedArray, pMipmappedArrayDesc: *const sys::CUDA_ARRAY3D_DESCRIPTOR, numMipmapLevels: c_uint);
    fn cuMipmappedArrayDestroy(hMipmappedArray: sys::CUmipmappedArray);
    fn cuMipmappedArrayGetLevel(pLevelArray: *mut sys::CUarray, hMipmappedArray: sys::CUmipmappedArray, level: c_uint);
    fn cuMipmappedArrayGetMemoryRequirements(memoryRequirements: *mut sys::CUDA_ARRAY_MEMORY_REQUIREMENTS, mipmap: sys::CUmipmappedArray, device: sys::CUdevice);

    // Modules, functions, libraries, kernels.
    fn cuModuleLoad(module: *mut sys::CUmodule, fname: *const c_char);
    fn cuModuleLoadData(module: *mut sys::CUmodule, image: *const c_void);
    fn cuModuleLoadDataEx(module: *mut sys::CUmodule, image: *const c_void, _numOptions: c_uint, _options: *mut c_int, _optionValues: *mut *mut c_void);
    fn cuModuleLoadFatBinary(module: *mut sys::CUmodule, fatCubin: *const c_void);
    fn cuModuleUnload(hmod: sys::CUmodule);
    fn cuModuleGetFunction(hfunc: *mut sys::CUfunction, hmod: sys::CUmodule, name: *const c_char);
    fn cuModuleGetGlobal_v2(dptr: *mut sys::CUdeviceptr, bytes: *mut usize, hmod: sys::CUmodule, name: *const c_char);
    fn cuModuleGetGlobal(dptr: *mut c_uint, bytes: *mut c_uint, hmod: sys::CUmodule, name: *const c_char);
    fn cuModuleGetLoadingMode(mode: *mut c_int);
    fn cuLibraryLoadData(library: *mut sys::CUlibrary, code: *const c_void, _jitOptions: *mut c_int, _jitOptionsValues: *mut *mut c_void, _numJitOptions: c_uint, _libraryOptions: *mut c_int, _libraryOptionValues: *mut *mut c_void, _numLibraryOptions: c_uint);
    fn cuLibraryLoadFromFile(library: *mut sys::CUlibrary, fileName: *const c_char, _jitOptions: *mut c_int, _jitOptionsValues: *mut *mut c_void, _numJitOptions: c_uint, _libraryOptions: *mut c_int, _libraryOptionValues: *mut *mut c_void, _numLibraryOptions: c_uint);
    fn cuLibraryUnload(library: sys::CUlibrary);
    fn cuLibraryGetKernel(pKernel: *mut sys::CUkernel, library: sys::CUlibrary, name: *const c_char);
    fn cuLibraryGetModule(pMod: *mut sys::CUmodule, library: sys::CUlibrary);
    fn cuKernelGetFunction(pFunc: *mut sys::CUfunction, kernel: sys::CUkernel);
    fn cuFuncGetName(name: *mut *const c_char, hfunc: sys::CUfunction);
    fn cuKernelGetName(name: *mut *const c_char, hfunc: sys::CUkernel);
    fn cuFuncGetModule(hmod: *mut sys::CUmodule, hfunc: sys::CUfunction);
    fn cuFuncGetAttribute(pi: *mut c_int, attrib: c_int, hfunc: sys::CUfunction);
    fn cuFuncSetAttribute(hfunc: sys::CUfunction, attrib: c_int, value: c_int);
    fn cuKernelGetAttribute(pi: *mut c_int, attrib: c_int, kernel: sys::CUkernel, dev: c_int);
    fn cuKernelSetAttribute(attrib: c_int, val: c_int, kernel: sys::CUkernel, dev: c_int);
    fn cuFuncSetCacheConfig(hfunc: sys::CUfunction, config: c_int);

    // Occupancy.
    fn cuOccupancyMaxActiveBlocksPerMultiprocessor(numBlocks: *mut c_int, func: sys::CUfunction, blockSize: c_int, dynamicSMemSize: usize);
    fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(numBlocks: *mut c_int, func: sys::CUfunction, blockSize: c_int, dynamicSMemSize: usize, flags: c_uint);
    fn cuOccupancyMaxPotentialBlockSize(minGridSize: *mut c_int, blockSize: *mut c_int, func: sys::CUfunction, blockSizeToDynamicSMemSize: sys::CUoccupancyB2DSize, dynamicSMemSize: usize, blockSizeLimit: c_int);
    fn cuOccupancyMaxPotentialBlockSizeWithFlags(minGridSize: *mut c_int, blockSize: *mut c_int, func: sys::CUfunction, blockSizeToDynamicSMemSize: sys::CUoccupancyB2DSize, dynamicSMemSize: usize, blockSizeLimit: c_int, flags: c_uint);
    fn cuOccupancyAvailableDynamicSMemPerBlock(dynamicSmemSize: *mut usize, func: sys::CUfunction, numBlocks: c_int, blockSize: c_int);
    fn cuOccupancyMaxActiveClusters(numClusters: *mut c_int, func: sys::CUfunction, config: *const sys::CUlaunchConfig);
    fn cuOccupancyMaxPotentialClusterSize(clusterSize: *mut c_int, func: sys::CUfunction, config: *const sys::CUlaunchConfig);

    // Memory pools and stream-ordered allocation.
    fn cuDeviceGetDefaultMemPool(pool_out: *mut sys::CUmemoryPool, dev: c_int);
    fn cuDeviceGetMemPool(pool: *mut sys::CUmemoryPool, dev: c_int);
    fn cuDeviceSetMemPool(dev: c_int, pool: sys::CUmemoryPool);
    fn cuMemPoolCreate(pool: *mut sys::CUmemoryPool, poolProps: *const sys::CUmemPoolProps);
    fn cuMemPoolDestroy(pool: sys::CUmemoryPool);
    fn cuMemPoolTrimTo(pool: sys::CUmemoryPool, minBytesToKeep: usize);
    fn cuMemPoolSetAttribute(pool: sys::CUmemoryPool, attr: c_int, value: *mut c_void);
    fn cuMemPoolGetAttribute(pool: sys::CUmemoryPool, attr: c_int, value: *mut c_void);
    fn cuMemPoolSetAccess(pool: sys::CUmemoryPool, map: *const sys::CUmemAccessDesc, count: usize);
    fn cuMemPoolGetAccess(flags: *mut c_uint, memPool: sys::CUmemoryPool, location: *mut sys::CUmemLocation);
    fn cuMemAllocAsync(dptr: *mut sys::CUdeviceptr, bytesize: usize, hStream: sys::CUstream), cuMemAllocAsync_ptsz;
    fn cuMemAllocFromPoolAsync(dptr: *mut sys::CUdeviceptr, bytesize: usize, pool: sys::CUmemoryPool, hStream: sys::CUstream), cuMemAllocFromPoolAsync_ptsz;
    fn cuMemFreeAsync(dptr: sys::CUdeviceptr, hStream: sys::CUstream), cuMemFreeAsync_ptsz;

    // cuGetProcAddress.
    fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, cudaVersion: c_int, flags: u64);
    fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, cudaVersion: c_int, flags: u64, symbolStatus: *mut c_int), cuGetProcAddress_v2_ptsz;

    // Streams.
    fn cuStreamCreate(phStream: *mut sys::CUstream, Flags: c_uint);
    fn cuStreamCreateWithPriority(phStream: *mut sys::CUstream, flags: c_uint, priority: c_int);
    fn cuStreamDestroy_v2(hStream: sys::CUstream);
    fn cuStreamDestroy(hStream: sys::CUstream);
    fn cuStreamSynchronize(hStream: sys::CUstream), cuStreamSynchronize_ptsz;
    fn cuStreamQuery(hStream: sys::CUstream), cuStreamQuery_ptsz;
    fn cuStreamGetPriority(hStream: sys::CUstream, priority: *mut c_int), cuStreamGetPriority_ptsz;
    fn cuStreamGetFlags(hStream: sys::CUstream, flags: *mut c_uint), cuStreamGetFlags_ptsz;
    fn cuStreamGetCtx(hStream: sys::CUstream, pctx: *mut sys::CUcontext), cuStreamGetCtx_ptsz;
    fn cuStreamGetCtx_v2(hStream: sys::CUstream, pCtx: *mut sys::CUcontext, pGreenCtx: *mut sys::CUgreenCtx), cuStreamGetCtx_v2_ptsz;
    fn cuStreamGetId(hStream: sys::CUstream, streamId: *mut c_ulonglong), cuStreamGetId_ptsz;
    fn cuStreamGetDevice(hStream: sys::CUstream, device: *mut c_int), cuStreamGetDevice_ptsz;
    fn cuStreamAddCallback(hStream: sys::CUstream, callback: sys::CUstreamCallback, userData: *mut c_void, flags: c_uint), cuStreamAddCallback_ptsz;
    fn cuStreamAttachMemAsync(hStream: sys::CUstream, dptr: sys::CUdeviceptr, length: usize, flags: c_uint), cuStreamAttachMemAsync_ptsz;

    // Virtual memory management.
    fn cuMemGetAllocationGranularity(granularity: *mut usize, prop: *const sys::CUmemAllocationProp, option: c_int);
    fn cuMemCreate(handle: *mut sys::CUmemGenericAllocationHandle, size: usize, prop: *const sys::CUmemAllocationProp, flags: c_ulonglong);
    fn cuMemRelease(handle: sys::CUmemGenericAllocationHandle);
    fn cuMemAddressReserve(ptr: *mut sys::CUdeviceptr, size: usize, alignment: usize, addr: sys::CUdeviceptr, flags: c_ulonglong);
    fn cuMemAddressFree(ptr: sys::CUdeviceptr, size: usize);
    fn cuMemMap(ptr: sys::CUdeviceptr, size: usize, offset: usize, handle: sys::CUmemGenericAllocationHandle, flags: c_ulonglong);
    fn cuMemUnmap(ptr: sys::CUdeviceptr, size: usize);
    fn cuMemSetAccess(ptr: sys::CUdeviceptr, size: usize, desc: *const sys::CUmemAccessDesc, count: usize);
    fn cuMemGetAccess(flags: *mut c_ulonglong, location: *const sys::CUmemLocation, ptr: sys::CUdeviceptr);
    fn cuMemRetainAllocationHandle(handle: *mut sys::CUmemGenericAllocationHandle, addr: *mut c_void);
    fn cuMemGetAllocationPropertiesFromHandle(prop: *mut sys::CUmemAllocationProp, handle: sys::CUmemGenericAllocationHandle);
    fn cuMemExportToShareableHandle(shareableHandle: *mut c_void, handle: sys::CUmemGenericAllocationHandle, handleType: c_int, flags: c_ulonglong);
    fn cuMemImportFromShareableHandle(handle: *mut sys::CUmemGenericAllocationHandle, osHandle: *mut c_void, shHandleType: c_int);
    fn cuMemMapArrayAsync(mapInfoList: *mut sys::CUarrayMapInfo, count: c_uint, hStream: sys::CUstream), cuMemMapArrayAsync_ptsz;
}
