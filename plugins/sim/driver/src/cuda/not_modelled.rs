//! Functions a real driver exports that the sim does not model: each answers
//! `CUDA_ERROR_NOT_SUPPORTED` (and says so under `TESSERA_SIM_TRACE`), so that a program, or the
//! CUDA runtime, which looks every function up at start, gets a function, never a null lookup,
//! and a clear code if it calls one.
//!
//! One line per exported name: `symbol = "base name" version flavour;`, as `cudaTypedefs.h` (CUDA
//! 12.8) declares its `PFN_<base>_v<version>[_ptds|_ptsz]` typedefs (the n-th version of a base
//! name is exported as `<base>`, `<base>_v2`, ...; a per-thread flavour as the version it extends
//! plus `_ptds`/`_ptsz`). The list is what libcudart 12.x looks up and the sim lacks; modelling a
//! function means implementing it in its family's module and moving its line to
//! [`super::proc_table`].
//!
//! The exports take no parameters: under the C calling convention a caller may pass any arguments
//! to such a function, and the answer does not depend on them.

use super::proc_table::{Entry, Pt};
use super::{CUresult, NOT_SUPPORTED};

fn not_modelled(symbol: &str) -> CUresult {
    super::trace::line(format_args!("{symbol} called: not modelled (CUDA_ERROR_NOT_SUPPORTED)"));
    NOT_SUPPORTED
}

macro_rules! not_modelled {
    ($($symbol:ident = $base:literal $version:literal $pt:ident;)*) => {
        $(
            #[unsafe(no_mangle)]
            pub extern "C" fn $symbol() -> CUresult {
                crate::ffi::guard(CUresult::CUDA_ERROR_UNKNOWN, || not_modelled(stringify!($symbol)))
            }
        )*

        /// The `cuGetProcAddress` entries of these functions.
        pub(crate) static ENTRIES: &[Entry] = &[
            $(Entry { name: $base, version: $version, pt: Pt::$pt, symbol: stringify!($symbol), f: $symbol as *const () },)*
        ];
    };
}

#[rustfmt::skip]
not_modelled! {
    cuArrayGetMemoryRequirements = "cuArrayGetMemoryRequirements" 11060 No;
    cuArrayGetPlane = "cuArrayGetPlane" 11020 No;
    cuArrayGetSparseProperties = "cuArrayGetSparseProperties" 11010 No;
    cuCtxDetach = "cuCtxDetach" 2000 No;
    cuCtxGetSharedMemConfig = "cuCtxGetSharedMemConfig" 4020 No;
    cuCtxSetSharedMemConfig = "cuCtxSetSharedMemConfig" 4020 No;
    cuDestroyExternalMemory = "cuDestroyExternalMemory" 10000 No;
    cuDestroyExternalSemaphore = "cuDestroyExternalSemaphore" 10000 No;
    cuDeviceGetGraphMemAttribute = "cuDeviceGetGraphMemAttribute" 11040 No;
    cuDeviceGetNvSciSyncAttributes = "cuDeviceGetNvSciSyncAttributes" 10020 No;
    cuDeviceGetTexture1DLinearMaxWidth = "cuDeviceGetTexture1DLinearMaxWidth" 11010 No;
    cuDeviceGraphMemTrim = "cuDeviceGraphMemTrim" 11040 No;
    cuDeviceRegisterAsyncNotification = "cuDeviceRegisterAsyncNotification" 12040 No;
    cuDeviceSetGraphMemAttribute = "cuDeviceSetGraphMemAttribute" 11040 No;
    cuDeviceUnregisterAsyncNotification = "cuDeviceUnregisterAsyncNotification" 12040 No;
    cuEGLStreamConsumerAcquireFrame = "cuEGLStreamConsumerAcquireFrame" 7000 No;
    cuEGLStreamConsumerConnect = "cuEGLStreamConsumerConnect" 7000 No;
    cuEGLStreamConsumerConnectWithFlags = "cuEGLStreamConsumerConnectWithFlags" 8000 No;
    cuEGLStreamConsumerDisconnect = "cuEGLStreamConsumerDisconnect" 7000 No;
    cuEGLStreamConsumerReleaseFrame = "cuEGLStreamConsumerReleaseFrame" 7000 No;
    cuEGLStreamProducerConnect = "cuEGLStreamProducerConnect" 7000 No;
    cuEGLStreamProducerDisconnect = "cuEGLStreamProducerDisconnect" 7000 No;
    cuEGLStreamProducerPresentFrame = "cuEGLStreamProducerPresentFrame" 7000 No;
    cuEGLStreamProducerReturnFrame = "cuEGLStreamProducerReturnFrame" 7000 No;
    cuExternalMemoryGetMappedBuffer = "cuExternalMemoryGetMappedBuffer" 10000 No;
    cuExternalMemoryGetMappedMipmappedArray = "cuExternalMemoryGetMappedMipmappedArray" 10000 No;
    cuFlushGPUDirectRDMAWrites = "cuFlushGPUDirectRDMAWrites" 11030 No;
    cuFuncGetParamInfo = "cuFuncGetParamInfo" 12040 No;
    cuFuncSetSharedMemConfig = "cuFuncSetSharedMemConfig" 4020 No;
    cuGLCtxCreate = "cuGLCtxCreate" 2000 No;
    cuGLCtxCreate_v2 = "cuGLCtxCreate" 3020 No;
    cuGLGetDevices = "cuGLGetDevices" 4010 No;
    cuGLGetDevices_v2 = "cuGLGetDevices" 6050 No;
    cuGLInit = "cuGLInit" 2000 No;
    cuGLMapBufferObject = "cuGLMapBufferObject" 2000 No;
    cuGLMapBufferObject_v2 = "cuGLMapBufferObject" 3020 No;
    cuGLMapBufferObject_v2_ptds = "cuGLMapBufferObject" 7000 Ptds;
    cuGLMapBufferObjectAsync = "cuGLMapBufferObjectAsync" 2030 No;
    cuGLMapBufferObjectAsync_v2 = "cuGLMapBufferObjectAsync" 3020 No;
    cuGLMapBufferObjectAsync_v2_ptsz = "cuGLMapBufferObjectAsync" 7000 Ptsz;
    cuGLRegisterBufferObject = "cuGLRegisterBufferObject" 2000 No;
    cuGLSetBufferObjectMapFlags = "cuGLSetBufferObjectMapFlags" 2030 No;
    cuGLUnmapBufferObject = "cuGLUnmapBufferObject" 2000 No;
    cuGLUnmapBufferObjectAsync = "cuGLUnmapBufferObjectAsync" 2030 No;
    cuGLUnregisterBufferObject = "cuGLUnregisterBufferObject" 2000 No;
    cuGraphAddChildGraphNode = "cuGraphAddChildGraphNode" 10000 No;
    cuGraphAddDependencies = "cuGraphAddDependencies" 10000 No;
    cuGraphAddDependencies_v2 = "cuGraphAddDependencies" 12030 No;
    cuGraphAddEventRecordNode = "cuGraphAddEventRecordNode" 11010 No;
    cuGraphAddEventWaitNode = "cuGraphAddEventWaitNode" 11010 No;
    cuGraphAddExternalSemaphoresSignalNode = "cuGraphAddExternalSemaphoresSignalNode" 11020 No;
    cuGraphAddExternalSemaphoresWaitNode = "cuGraphAddExternalSemaphoresWaitNode" 11020 No;
    cuGraphAddMemAllocNode = "cuGraphAddMemAllocNode" 11040 No;
    cuGraphAddMemFreeNode = "cuGraphAddMemFreeNode" 11040 No;
    cuGraphAddMemcpyNode = "cuGraphAddMemcpyNode" 10000 No;
    cuGraphAddNode = "cuGraphAddNode" 12020 No;
    cuGraphAddNode_v2 = "cuGraphAddNode" 12030 No;
    cuGraphChildGraphNodeGetGraph = "cuGraphChildGraphNodeGetGraph" 10000 No;
    cuGraphClone = "cuGraphClone" 10000 No;
    cuGraphConditionalHandleCreate = "cuGraphConditionalHandleCreate" 12030 No;
    cuGraphDebugDotPrint = "cuGraphDebugDotPrint" 11030 No;
    cuGraphDestroyNode = "cuGraphDestroyNode" 10000 No;
    cuGraphEventRecordNodeGetEvent = "cuGraphEventRecordNodeGetEvent" 11010 No;
    cuGraphEventRecordNodeSetEvent = "cuGraphEventRecordNodeSetEvent" 11010 No;
    cuGraphEventWaitNodeGetEvent = "cuGraphEventWaitNodeGetEvent" 11010 No;
    cuGraphEventWaitNodeSetEvent = "cuGraphEventWaitNodeSetEvent" 11010 No;
    cuGraphExecChildGraphNodeSetParams = "cuGraphExecChildGraphNodeSetParams" 11010 No;
    cuGraphExecEventRecordNodeSetEvent = "cuGraphExecEventRecordNodeSetEvent" 11010 No;
    cuGraphExecEventWaitNodeSetEvent = "cuGraphExecEventWaitNodeSetEvent" 11010 No;
    cuGraphExecExternalSemaphoresSignalNodeSetParams = "cuGraphExecExternalSemaphoresSignalNodeSetParams" 11020 No;
    cuGraphExecExternalSemaphoresWaitNodeSetParams = "cuGraphExecExternalSemaphoresWaitNodeSetParams" 11020 No;
    cuGraphExecGetFlags = "cuGraphExecGetFlags" 12000 No;
    cuGraphExecHostNodeSetParams = "cuGraphExecHostNodeSetParams" 10020 No;
    cuGraphExecKernelNodeSetParams = "cuGraphExecKernelNodeSetParams" 10010 No;
    cuGraphExecKernelNodeSetParams_v2 = "cuGraphExecKernelNodeSetParams" 12000 No;
    cuGraphExecMemcpyNodeSetParams = "cuGraphExecMemcpyNodeSetParams" 10020 No;
    cuGraphExecMemsetNodeSetParams = "cuGraphExecMemsetNodeSetParams" 10020 No;
    cuGraphExecNodeSetParams = "cuGraphExecNodeSetParams" 12020 No;
    cuGraphExecUpdate = "cuGraphExecUpdate" 10020 No;
    cuGraphExecUpdate_v2 = "cuGraphExecUpdate" 12000 No;
    cuGraphExternalSemaphoresSignalNodeGetParams = "cuGraphExternalSemaphoresSignalNodeGetParams" 11020 No;
    cuGraphExternalSemaphoresSignalNodeSetParams = "cuGraphExternalSemaphoresSignalNodeSetParams" 11020 No;
    cuGraphExternalSemaphoresWaitNodeGetParams = "cuGraphExternalSemaphoresWaitNodeGetParams" 11020 No;
    cuGraphExternalSemaphoresWaitNodeSetParams = "cuGraphExternalSemaphoresWaitNodeSetParams" 11020 No;
    cuGraphGetEdges = "cuGraphGetEdges" 10000 No;
    cuGraphGetEdges_v2 = "cuGraphGetEdges" 12030 No;
    cuGraphGetRootNodes = "cuGraphGetRootNodes" 10000 No;
    cuGraphHostNodeGetParams = "cuGraphHostNodeGetParams" 10000 No;
    cuGraphHostNodeSetParams = "cuGraphHostNodeSetParams" 10000 No;
    cuGraphKernelNodeCopyAttributes = "cuGraphKernelNodeCopyAttributes" 11000 No;
    cuGraphKernelNodeGetAttribute = "cuGraphKernelNodeGetAttribute" 11000 No;
    cuGraphKernelNodeGetParams = "cuGraphKernelNodeGetParams" 10000 No;
    cuGraphKernelNodeGetParams_v2 = "cuGraphKernelNodeGetParams" 12000 No;
    cuGraphKernelNodeSetAttribute = "cuGraphKernelNodeSetAttribute" 11000 No;
    cuGraphKernelNodeSetParams = "cuGraphKernelNodeSetParams" 10000 No;
    cuGraphKernelNodeSetParams_v2 = "cuGraphKernelNodeSetParams" 12000 No;
    cuGraphMemAllocNodeGetParams = "cuGraphMemAllocNodeGetParams" 11040 No;
    cuGraphMemFreeNodeGetParams = "cuGraphMemFreeNodeGetParams" 11040 No;
    cuGraphMemcpyNodeGetParams = "cuGraphMemcpyNodeGetParams" 10000 No;
    cuGraphMemcpyNodeSetParams = "cuGraphMemcpyNodeSetParams" 10000 No;
    cuGraphMemsetNodeGetParams = "cuGraphMemsetNodeGetParams" 10000 No;
    cuGraphMemsetNodeSetParams = "cuGraphMemsetNodeSetParams" 10000 No;
    cuGraphNodeFindInClone = "cuGraphNodeFindInClone" 10000 No;
    cuGraphNodeGetDependencies = "cuGraphNodeGetDependencies" 10000 No;
    cuGraphNodeGetDependencies_v2 = "cuGraphNodeGetDependencies" 12030 No;
    cuGraphNodeGetDependentNodes = "cuGraphNodeGetDependentNodes" 10000 No;
    cuGraphNodeGetDependentNodes_v2 = "cuGraphNodeGetDependentNodes" 12030 No;
    cuGraphNodeGetEnabled = "cuGraphNodeGetEnabled" 11060 No;
    cuGraphNodeSetEnabled = "cuGraphNodeSetEnabled" 11060 No;
    cuGraphNodeSetParams = "cuGraphNodeSetParams" 12020 No;
    cuGraphReleaseUserObject = "cuGraphReleaseUserObject" 11030 No;
    cuGraphRemoveDependencies = "cuGraphRemoveDependencies" 10000 No;
    cuGraphRemoveDependencies_v2 = "cuGraphRemoveDependencies" 12030 No;
    cuGraphRetainUserObject = "cuGraphRetainUserObject" 11030 No;
    cuGraphicsEGLRegisterImage = "cuGraphicsEGLRegisterImage" 7000 No;
    cuGraphicsGLRegisterBuffer = "cuGraphicsGLRegisterBuffer" 3000 No;
    cuGraphicsGLRegisterImage = "cuGraphicsGLRegisterImage" 3000 No;
    cuGraphicsMapResources = "cuGraphicsMapResources" 3000 No;
    cuGraphicsMapResources_ptsz = "cuGraphicsMapResources" 7000 Ptsz;
    cuGraphicsResourceGetMappedEglFrame = "cuGraphicsResourceGetMappedEglFrame" 7000 No;
    cuGraphicsResourceGetMappedMipmappedArray = "cuGraphicsResourceGetMappedMipmappedArray" 5000 No;
    cuGraphicsResourceGetMappedPointer = "cuGraphicsResourceGetMappedPointer" 3000 No;
    cuGraphicsResourceGetMappedPointer_v2 = "cuGraphicsResourceGetMappedPointer" 3020 No;
    cuGraphicsResourceSetMapFlags = "cuGraphicsResourceSetMapFlags" 3000 No;
    cuGraphicsResourceSetMapFlags_v2 = "cuGraphicsResourceSetMapFlags" 6050 No;
    cuGraphicsSubResourceGetMappedArray = "cuGraphicsSubResourceGetMappedArray" 3000 No;
    cuGraphicsUnmapResources = "cuGraphicsUnmapResources" 3000 No;
    cuGraphicsUnmapResources_ptsz = "cuGraphicsUnmapResources" 7000 Ptsz;
    cuGraphicsUnregisterResource = "cuGraphicsUnregisterResource" 3000 No;
    cuGraphicsVDPAURegisterOutputSurface = "cuGraphicsVDPAURegisterOutputSurface" 3010 No;
    cuGraphicsVDPAURegisterVideoSurface = "cuGraphicsVDPAURegisterVideoSurface" 3010 No;
    cuImportExternalMemory = "cuImportExternalMemory" 10000 No;
    cuImportExternalSemaphore = "cuImportExternalSemaphore" 10000 No;
    cuIpcCloseMemHandle = "cuIpcCloseMemHandle" 4010 No;
    cuIpcGetEventHandle = "cuIpcGetEventHandle" 4010 No;
    cuIpcGetMemHandle = "cuIpcGetMemHandle" 4010 No;
    cuIpcOpenEventHandle = "cuIpcOpenEventHandle" 4010 No;
    cuIpcOpenMemHandle = "cuIpcOpenMemHandle" 4010 No;
    cuIpcOpenMemHandle_v2 = "cuIpcOpenMemHandle" 11000 No;
    cuKernelGetParamInfo = "cuKernelGetParamInfo" 12040 No;
    cuKernelSetCacheConfig = "cuKernelSetCacheConfig" 12000 No;
    cuLaunchCooperativeKernelMultiDevice = "cuLaunchCooperativeKernelMultiDevice" 9000 No;
    cuLibraryEnumerateKernels = "cuLibraryEnumerateKernels" 12040 No;
    cuLibraryGetGlobal = "cuLibraryGetGlobal" 12000 No;
    cuLibraryGetKernelCount = "cuLibraryGetKernelCount" 12040 No;
    cuLibraryGetManaged = "cuLibraryGetManaged" 12000 No;
    cuLibraryGetUnifiedFunction = "cuLibraryGetUnifiedFunction" 12000 No;
    cuMemPoolExportPointer = "cuMemPoolExportPointer" 11020 No;
    cuMemPoolExportToShareableHandle = "cuMemPoolExportToShareableHandle" 11020 No;
    cuMemPoolImportFromShareableHandle = "cuMemPoolImportFromShareableHandle" 11020 No;
    cuMemPoolImportPointer = "cuMemPoolImportPointer" 11020 No;
    cuMemRangeGetAttribute = "cuMemRangeGetAttribute" 8000 No;
    cuMemRangeGetAttributes = "cuMemRangeGetAttributes" 8000 No;
    cuMemcpy3D = "cuMemcpy3D" 2000 No;
    cuMemcpy3D_v2 = "cuMemcpy3D" 3020 No;
    cuMemcpy3D_v2_ptds = "cuMemcpy3D" 7000 Ptds;
    cuMemcpy3DAsync = "cuMemcpy3DAsync" 2000 No;
    cuMemcpy3DAsync_v2 = "cuMemcpy3DAsync" 3020 No;
    cuMemcpy3DAsync_v2_ptsz = "cuMemcpy3DAsync" 7000 Ptsz;
    cuMemcpy3DBatchAsync = "cuMemcpy3DBatchAsync" 12080 No;
    cuMemcpy3DBatchAsync_ptsz = "cuMemcpy3DBatchAsync" 12080 Ptsz;
    cuMemcpy3DPeer = "cuMemcpy3DPeer" 4000 No;
    cuMemcpy3DPeer_ptds = "cuMemcpy3DPeer" 7000 Ptds;
    cuMemcpy3DPeerAsync = "cuMemcpy3DPeerAsync" 4000 No;
    cuMemcpy3DPeerAsync_ptsz = "cuMemcpy3DPeerAsync" 7000 Ptsz;
    cuMemcpyBatchAsync = "cuMemcpyBatchAsync" 12080 No;
    cuMemcpyBatchAsync_ptsz = "cuMemcpyBatchAsync" 12080 Ptsz;
    cuMipmappedArrayCreate = "cuMipmappedArrayCreate" 5000 No;
    cuMipmappedArrayDestroy = "cuMipmappedArrayDestroy" 5000 No;
    cuMipmappedArrayGetLevel = "cuMipmappedArrayGetLevel" 5000 No;
    cuMipmappedArrayGetMemoryRequirements = "cuMipmappedArrayGetMemoryRequirements" 11060 No;
    cuMipmappedArrayGetSparseProperties = "cuMipmappedArrayGetSparseProperties" 11010 No;
    cuModuleGetSurfRef = "cuModuleGetSurfRef" 3000 No;
    cuModuleGetTexRef = "cuModuleGetTexRef" 2000 No;
    cuOccupancyMaxActiveClusters = "cuOccupancyMaxActiveClusters" 11070 No;
    cuOccupancyMaxPotentialClusterSize = "cuOccupancyMaxPotentialClusterSize" 11070 No;
    cuProfilerInitialize = "cuProfilerInitialize" 4000 No;
    cuProfilerStart = "cuProfilerStart" 4000 No;
    cuProfilerStop = "cuProfilerStop" 4000 No;
    cuSignalExternalSemaphoresAsync = "cuSignalExternalSemaphoresAsync" 10000 No;
    cuSignalExternalSemaphoresAsync_ptsz = "cuSignalExternalSemaphoresAsync" 10000 Ptsz;
    cuStreamBatchMemOp = "cuStreamBatchMemOp" 8000 No;
    cuStreamBatchMemOp_ptsz = "cuStreamBatchMemOp" 8000 Ptsz;
    cuStreamBatchMemOp_v2 = "cuStreamBatchMemOp" 11070 No;
    cuStreamBatchMemOp_v2_ptsz = "cuStreamBatchMemOp" 11070 Ptsz;
    cuStreamBeginCaptureToGraph = "cuStreamBeginCaptureToGraph" 12030 No;
    cuStreamBeginCaptureToGraph_ptsz = "cuStreamBeginCaptureToGraph" 12030 Ptsz;
    cuStreamCopyAttributes = "cuStreamCopyAttributes" 11000 No;
    cuStreamCopyAttributes_ptsz = "cuStreamCopyAttributes" 11000 Ptsz;
    cuStreamGetAttribute = "cuStreamGetAttribute" 11000 No;
    cuStreamGetAttribute_ptsz = "cuStreamGetAttribute" 11000 Ptsz;
    cuStreamSetAttribute = "cuStreamSetAttribute" 11000 No;
    cuStreamSetAttribute_ptsz = "cuStreamSetAttribute" 11000 Ptsz;
    cuStreamUpdateCaptureDependencies = "cuStreamUpdateCaptureDependencies" 11030 No;
    cuStreamUpdateCaptureDependencies_ptsz = "cuStreamUpdateCaptureDependencies" 11030 Ptsz;
    cuStreamUpdateCaptureDependencies_v2 = "cuStreamUpdateCaptureDependencies" 12030 No;
    cuStreamUpdateCaptureDependencies_v2_ptsz = "cuStreamUpdateCaptureDependencies" 12030 Ptsz;
    cuStreamWaitValue32 = "cuStreamWaitValue32" 8000 No;
    cuStreamWaitValue32_ptsz = "cuStreamWaitValue32" 8000 Ptsz;
    cuStreamWaitValue32_v2 = "cuStreamWaitValue32" 11070 No;
    cuStreamWaitValue32_v2_ptsz = "cuStreamWaitValue32" 11070 Ptsz;
    cuStreamWaitValue64 = "cuStreamWaitValue64" 9000 No;
    cuStreamWaitValue64_ptsz = "cuStreamWaitValue64" 9000 Ptsz;
    cuStreamWaitValue64_v2 = "cuStreamWaitValue64" 11070 No;
    cuStreamWaitValue64_v2_ptsz = "cuStreamWaitValue64" 11070 Ptsz;
    cuStreamWriteValue32 = "cuStreamWriteValue32" 8000 No;
    cuStreamWriteValue32_ptsz = "cuStreamWriteValue32" 8000 Ptsz;
    cuStreamWriteValue32_v2 = "cuStreamWriteValue32" 11070 No;
    cuStreamWriteValue32_v2_ptsz = "cuStreamWriteValue32" 11070 Ptsz;
    cuStreamWriteValue64 = "cuStreamWriteValue64" 9000 No;
    cuStreamWriteValue64_ptsz = "cuStreamWriteValue64" 9000 Ptsz;
    cuStreamWriteValue64_v2 = "cuStreamWriteValue64" 11070 No;
    cuStreamWriteValue64_v2_ptsz = "cuStreamWriteValue64" 11070 Ptsz;
    cuSurfObjectCreate = "cuSurfObjectCreate" 5000 No;
    cuSurfObjectDestroy = "cuSurfObjectDestroy" 5000 No;
    cuSurfObjectGetResourceDesc = "cuSurfObjectGetResourceDesc" 5000 No;
    cuTexObjectCreate = "cuTexObjectCreate" 5000 No;
    cuTexObjectDestroy = "cuTexObjectDestroy" 5000 No;
    cuTexObjectGetResourceDesc = "cuTexObjectGetResourceDesc" 5000 No;
    cuTexObjectGetResourceViewDesc = "cuTexObjectGetResourceViewDesc" 5000 No;
    cuTexObjectGetTextureDesc = "cuTexObjectGetTextureDesc" 5000 No;
    cuUserObjectCreate = "cuUserObjectCreate" 11030 No;
    cuUserObjectRelease = "cuUserObjectRelease" 11030 No;
    cuUserObjectRetain = "cuUserObjectRetain" 11030 No;
    cuVDPAUCtxCreate = "cuVDPAUCtxCreate" 3010 No;
    cuVDPAUCtxCreate_v2 = "cuVDPAUCtxCreate" 3020 No;
    cuVDPAUGetDevice = "cuVDPAUGetDevice" 3010 No;
    cuWaitExternalSemaphoresAsync = "cuWaitExternalSemaphoresAsync" 10000 No;
    cuWaitExternalSemaphoresAsync_ptsz = "cuWaitExternalSemaphoresAsync" 10000 Ptsz;
}
