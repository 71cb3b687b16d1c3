//! `backend::select` (`serve --device cpu|cuda|auto`) on the real model.
//!
//! Where a GPU is expected (SLIPWAY_EXPECT_GPU=1, set by `make test-gpu`), `cuda` and
//! `auto` must start the CUDA backend; elsewhere (`make test`) `cuda` must fail saying
//! why and `auto` must fall back to the CPU backend.

use slipway_engine::backend::{
    BackendOptions, Device, DeviceChoice, SelectError, device::runner::DeviceConfig, select,
};
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::testing::model_path;

fn options() -> BackendOptions {
    let mut o = BackendOptions::default();
    o.cpu.num_blocks = 64;
    o.cuda = DeviceConfig {
        num_blocks: Some(64),
        ..DeviceConfig::default()
    };
    o
}

#[test]
fn device_choice_parses_and_selects() {
    assert_eq!("cuda".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda));
    assert_eq!("auto".parse::<DeviceChoice>(), Ok(DeviceChoice::Auto));
    assert!("gpu".parse::<DeviceChoice>().is_err());
    let path = model_path();
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let o = options();
    let (cpu, which) = select(DeviceChoice::Cpu, &file, &o).expect("cpu backend");
    assert_eq!(which, Device::Cpu);
    assert_eq!(cpu.kv_geometry().num_blocks, 64);
    let expect_gpu = std::env::var("SLIPWAY_EXPECT_GPU").is_ok_and(|v| v == "1");
    let auto = select(DeviceChoice::Auto, &file, &o).expect("auto always starts a backend");
    let cuda = select(DeviceChoice::Cuda, &file, &o);
    if expect_gpu {
        assert_eq!(auto.1, Device::Cuda);
        let (runner, which) = cuda.unwrap_or_else(|e| panic!("a GPU was expected: {e}"));
        assert_eq!(which, Device::Cuda);
        assert_eq!(runner.kv_geometry().num_blocks, 64);
    } else {
        assert_eq!(
            auto.1,
            Device::Cpu,
            "no GPU here: auto falls back to the CPU"
        );
        match cuda {
            Err(SelectError::CudaUnavailable(reason)) => {
                assert!(!reason.is_empty());
                println!("cuda unavailable, as expected here: {reason}");
            }
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!(
                "a CUDA backend started where no GPU was expected (set SLIPWAY_EXPECT_GPU=1 on GPU machines)"
            ),
        }
    }
}
