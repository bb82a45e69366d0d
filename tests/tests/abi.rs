//! Independent ABI guard: hand-written expectations of NCCL's net ABI (the
//! properties struct's sizes and offsets and each table's member count per
//! version, as NCCL's headers declare them), checked against the generated
//! types.
//! It does not read the descriptors, so a wrong descriptor fails here even
//! where CI has no NCCL headers to compare against (v9..v12).

use std::mem::{offset_of, size_of};

// The generated modules live at the plugin crate's root.
use weft as g;

const PTR: usize = size_of::<usize>();

#[test]
fn properties_sizes() {
    weft_tests::isolated!();
    assert_eq!(size_of::<g::net_v5::ncclNetProperties_v5_t>(), 48);
    assert_eq!(size_of::<g::net_v6::ncclNetProperties_v6_t>(), 48);
    assert_eq!(size_of::<g::net_v7::ncclNetProperties_v7_t>(), 56);
    assert_eq!(size_of::<g::net_v8::ncclNetProperties_v8_t>(), 64);
    assert_eq!(size_of::<g::net_v9::ncclNetProperties_v9_t>(), 104);
    assert_eq!(size_of::<g::net_v10::ncclNetProperties_v10_t>(), 104);
    assert_eq!(size_of::<g::net_v11::ncclNetProperties_v11_t>(), 112);
    assert_eq!(size_of::<g::net_v12::ncclNetProperties_v12_t>(), 128);
}

#[test]
fn properties_offsets() {
    weft_tests::isolated!();
    assert_eq!(offset_of!(g::net_v5::ncclNetProperties_v5_t, maxRecvs), 44);
    assert_eq!(offset_of!(g::net_v6::ncclNetProperties_v6_t, maxRecvs), 44);
    assert_eq!(offset_of!(g::net_v7::ncclNetProperties_v7_t, maxRecvs), 44);
    assert_eq!(
        offset_of!(g::net_v8::ncclNetProperties_v8_t, regIsGlobal),
        28
    );
    assert_eq!(offset_of!(g::net_v8::ncclNetProperties_v8_t, maxRecvs), 48);
    for (recvs, vprops, p2p) in [
        (
            offset_of!(g::net_v9::ncclNetProperties_v9_t, maxRecvs),
            offset_of!(g::net_v9::ncclNetProperties_v9_t, vProps),
            offset_of!(g::net_v9::ncclNetProperties_v9_t, maxP2pBytes),
        ),
        (
            offset_of!(g::net_v10::ncclNetProperties_v10_t, maxRecvs),
            offset_of!(g::net_v10::ncclNetProperties_v10_t, vProps),
            offset_of!(g::net_v10::ncclNetProperties_v10_t, maxP2pBytes),
        ),
        (
            offset_of!(g::net_v11::ncclNetProperties_v11_t, maxRecvs),
            offset_of!(g::net_v11::ncclNetProperties_v11_t, vProps),
            offset_of!(g::net_v11::ncclNetProperties_v11_t, maxP2pBytes),
        ),
    ] {
        assert_eq!((recvs, vprops, p2p), (52, 64, 88));
    }
    assert_eq!(
        offset_of!(g::net_v11::ncclNetProperties_v11_t, maxMultiRequestSize),
        104
    );
    assert_eq!(
        offset_of!(g::net_v12::ncclNetProperties_v12_t, maxRecvs),
        52
    );
    assert_eq!(offset_of!(g::net_v12::ncclNetProperties_v12_t, vProps), 64);
    assert_eq!(
        offset_of!(g::net_v12::ncclNetProperties_v12_t, maxP2pBytes),
        104
    );
    assert_eq!(
        offset_of!(g::net_v12::ncclNetProperties_v12_t, maxCollBytes),
        112
    );
    assert_eq!(
        offset_of!(g::net_v12::ncclNetProperties_v12_t, maxMultiRequestSize),
        120
    );
    assert_eq!(offset_of!(g::net_v12::ncclNetProperties_v12_t, railId), 124);
    assert_eq!(
        offset_of!(g::net_v12::ncclNetProperties_v12_t, planeId),
        126
    );
    assert_eq!(size_of::<g::net_v9::ncclNetVDeviceProps_v9_t>(), 20);
    assert_eq!(size_of::<g::net_v12::ncclNetVDeviceProps_v12_t>(), 36);
    assert_eq!(size_of::<g::net_v7::ncclNetDeviceHandle_v7_t>(), 32);
    assert_eq!(size_of::<g::net_v11::ncclNetAttr_v11_t>(), 44);
}

#[test]
fn net_member_counts() {
    weft_tests::isolated!();
    let counts = [
        size_of::<g::net_v5::ncclNet_v5_t>(),
        size_of::<g::net_v6::ncclNet_v6_t>(),
        size_of::<g::net_v7::ncclNet_v7_t>(),
        size_of::<g::net_v8::ncclNet_v8_t>(),
        size_of::<g::net_v9::ncclNet_v9_t>(),
        size_of::<g::net_v10::ncclNet_v10_t>(),
        size_of::<g::net_v11::ncclNet_v11_t>(),
        size_of::<g::net_v12::ncclNet_v12_t>(),
    ]
    .map(|s| s / PTR);
    assert_eq!(counts, [16, 17, 19, 19, 20, 20, 22, 22]);
}

#[test]
fn collnet_member_counts() {
    weft_tests::isolated!();
    let counts = [
        size_of::<g::collnet_v5::ncclCollNet_v5_t>(),
        size_of::<g::collnet_v6::ncclCollNet_v6_t>(),
        size_of::<g::collnet_v7::ncclCollNet_v7_t>(),
        size_of::<g::collnet_v8::ncclCollNet_v8_t>(),
        size_of::<g::collnet_v9::ncclCollNet_v9_t>(),
        size_of::<g::collnet_v10::ncclCollNet_v10_t>(),
        size_of::<g::collnet_v11::ncclCollNet_v11_t>(),
        size_of::<g::collnet_v12::ncclCollNet_v12_t>(),
    ]
    .map(|s| s / PTR);
    assert_eq!(counts, [14, 15, 15, 17, 18, 18, 19, 19]);
}

/// Signature changes NCCL made between versions (reference §2), checked on
/// the member offsets that moved.
#[test]
fn members_that_moved() {
    weft_tests::isolated!();
    // v6 inserted regMrDmaBuf after regMr.
    assert_eq!(offset_of!(g::net_v5::ncclNet_v5_t, deregMr), 8 * PTR);
    assert_eq!(offset_of!(g::net_v6::ncclNet_v6_t, deregMr), 9 * PTR);
    // v11 appended finalize and setNetAttr.
    assert_eq!(offset_of!(g::net_v11::ncclNet_v11_t, finalize), 20 * PTR);
    assert_eq!(offset_of!(g::net_v12::ncclNet_v12_t, setNetAttr), 21 * PTR);
    // CollNet v8 added iallgather and ireducescatter after iallreduce.
    assert_eq!(
        offset_of!(g::collnet_v8::ncclCollNet_v8_t, iflush),
        13 * PTR
    );
    assert_eq!(
        offset_of!(g::collnet_v11::ncclCollNet_v11_t, finalize),
        18 * PTR
    );
}

/// The RMA tables as NCCL's headers declare them: 21 members in v13 (GIN
/// v13's table) to v15, 22 in v16, whose `getRmaProperties` is inserted
/// fourth (a layout change, not an append); the configs and v16's
/// properties struct.
#[test]
fn rma_tables() {
    weft_tests::isolated!();
    assert_eq!(size_of::<g::rma_v13::ncclRma_v13_t>(), 21 * PTR);
    assert_eq!(size_of::<g::rma_v14::ncclRma_v14_t>(), 21 * PTR);
    assert_eq!(size_of::<g::rma_v15::ncclRma_v15_t>(), 21 * PTR);
    assert_eq!(size_of::<g::rma_v16::ncclRma_v16_t>(), 22 * PTR);
    assert_eq!(offset_of!(g::rma_v13::ncclRma_v13_t, ginProgress), 18 * PTR);
    assert_eq!(offset_of!(g::rma_v14::ncclRma_v14_t, rmaProgress), 18 * PTR);
    assert_eq!(offset_of!(g::rma_v15::ncclRma_v15_t, iput), 13 * PTR);
    assert_eq!(
        offset_of!(g::rma_v16::ncclRma_v16_t, getRmaProperties),
        3 * PTR
    );
    assert_eq!(
        offset_of!(g::rma_v16::ncclRma_v16_t, getProperties),
        4 * PTR
    );
    assert_eq!(offset_of!(g::rma_v16::ncclRma_v16_t, finalize), 21 * PTR);
    // v13's GIN config: nSignals, nCounters, nContexts, queueDepth, trafficClass.
    assert_eq!(size_of::<g::rma_v13::ncclGinConfig_v13_t>(), 20);
    assert_eq!(offset_of!(g::rma_v13::ncclGinConfig_v13_t, nContexts), 8);
    // v14+: nContexts, trafficClass, rankStride.
    assert_eq!(size_of::<g::rma_v14::ncclRmaConfig_v14_t>(), 12);
    assert_eq!(size_of::<g::rma_v16::ncclRmaConfig_v16_t>(), 12);
    assert_eq!(size_of::<g::rma_v16::ncclRmaProperties_v16_t>(), 1);
    // The devices are reported in v12's properties struct.
    assert_eq!(size_of::<g::rma_v14::ncclNetProperties_v14_t>(), 128);
}
