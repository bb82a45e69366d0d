//! Micro-costs as criterion timings (`cargo bench -p weft-tests --bench
//! micro`): Weft's freelist against the C intrusive freelist, an MR cache hit,
//! and `devices()` through the v5 and v12 adapters against the core directly.
//! Each measured iteration repeats the operation (x1000, or x4 rounds of the
//! burst, as the group names say), so criterion's own overhead stays out of
//! the figure; divide by the repeat count. `weft-bench --micro` gives the same cases as instruction
//! counts (callgrind), which this noisy machine cannot disturb.

use criterion::{black_box, criterion_group, criterion_main, Criterion};

use weft_tests::micro;

const N: u64 = 1000;

fn freelist(c: &mut Criterion) {
    let mut g = c.benchmark_group("freelist (x1000)");
    let mut cl = micro::CFreelist::new();
    let mut wl = micro::weft_freelist();
    g.bench_function("C alloc+free", |b| b.iter(|| cl.pair(black_box(N))));
    g.bench_function("Weft alloc+free", |b| {
        b.iter(|| micro::freelist_pair(&mut wl, black_box(N)))
    });
    g.finish();
    let mut g = c.benchmark_group("freelist 256 allocs then 256 frees (x4)");
    let mut held = Vec::with_capacity(micro::BURST);
    g.bench_function("C", |b| b.iter(|| cl.burst(black_box(4))));
    g.bench_function("Weft", |b| {
        b.iter(|| micro::freelist_burst(&mut wl, &mut held, black_box(4)))
    });
    g.finish();
}

fn mr_cache(c: &mut Criterion) {
    let buf = vec![0u8; 64 << 20];
    let (cache, held) = micro::mr_cache(&buf);
    let r = held[17].range();
    c.bench_function("MR cache hit (x1000)", |b| {
        b.iter(|| micro::mr_hit(&cache, r.start + 100, r.len() - 200, black_box(N)))
    });
}

fn adapters(c: &mut Criterion) {
    weft_tests::host::configure("shm");
    weft::core::init_process(None, None).expect("init");
    let mut g = c.benchmark_group("devices() (x1000)");
    g.bench_function("core", |b| b.iter(|| micro::core_devices(black_box(N))));
    let v5 = weft::net_v5::ncclNetPlugin_v5.devices.expect("devices");
    let v12 = weft::net_v12::ncclNetPlugin_v12.devices.expect("devices");
    g.bench_function("v5 adapter", |b| {
        b.iter(|| micro::table_devices(v5, black_box(N)))
    });
    g.bench_function("v12 adapter", |b| {
        b.iter(|| micro::table_devices(v12, black_box(N)))
    });
    g.finish();
}

criterion_group!(benches, freelist, mr_cache, adapters);
criterion_main!(benches);
