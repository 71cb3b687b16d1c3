//! `slipway-engine serve --lora NAME=PATH` as a real child process on the real
//! SmolLM2 model and the test adapter: the adapter is a model of its own in
//! `/v1/models`, the load report and the metrics' `adapter` label; an unknown model is
//! a 404 naming what is served; and every adapter problem stops the start-up with a
//! non-zero exit and the reason on its last line. A missing model or adapter fails
//! with instructions, never skips.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use slipway_contract::metrics::{
    ADAPTER_LABEL, MODEL_LABEL, OUTCOME_LABEL, Outcome, RELEASE_LABEL, REQUESTS, counter_total,
};
use slipway_contract::{DeviceChoice, LoraModule, NamedSha256, ServeArgs};
use slipway_engine::fetch::file_sha256;
use slipway_engine::model::gguf::Value as Meta;
use slipway_engine::model::gguf::write::GgufWriter;
use slipway_engine::testing::{self, EngineProcess, lora_adapter_path, model_path};

const MODEL: &str = "smollm2";

/// `serve` flags: the test model under [`MODEL`] on the CPU.
fn serve_args() -> ServeArgs {
    ServeArgs {
        release: "r1".into(),
        max_model_len: Some(1024),
        kv_blocks: Some(256),
        device: DeviceChoice::Cpu,
        ..testing::serve_args(MODEL)
    }
}

fn lora_flag(name: &str, path: &Path) -> String {
    format!("{name}={}", path.display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_are_served_names_and_unknown_models_get_a_404_listing_them() {
    let adapter = lora_adapter_path();
    let (sha, _) = file_sha256(&adapter).expect("hash the adapter");
    let server = EngineProcess::spawn(&ServeArgs {
        lora: vec![LoraModule {
            name: "sql".into(),
            path: adapter,
        }],
        lora_sha256: vec![NamedSha256 {
            name: "sql".into(),
            sha256: sha,
        }],
        ..serve_args()
    });
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .expect("client");

    let models: Value = c
        .get(server.url("/v1/models"))
        .send()
        .await
        .expect("GET /v1/models")
        .json()
        .await
        .expect("JSON");
    let ids: Vec<&str> = models["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, [MODEL, "sql"], "{models}");
    assert_eq!(models["data"][1]["parent"], MODEL);

    let load: Value = c
        .get(server.url("/load"))
        .send()
        .await
        .expect("GET /load")
        .json()
        .await
        .expect("JSON");
    assert_eq!(load["models"], json!([MODEL, "sql"]));

    let complete = |model: &str| {
        c.post(server.url("/v1/completions")).json(&json!({
            "model": model, "prompt": "Once upon a time, in a small village by the sea, there lived",
            "max_tokens": 8,
            "temperature": 0, "ignore_eos": true
        }))
    };
    let unknown = complete("sql-v2").send().await.expect("POST");
    assert_eq!(unknown.status(), reqwest::StatusCode::NOT_FOUND);
    let body: Value = unknown.json().await.expect("JSON error");
    let message = body["error"]["message"].as_str().expect("message");
    assert!(
        message.contains("`sql-v2`") && message.contains(MODEL) && message.contains("sql"),
        "{message}"
    );
    assert_eq!(body["error"]["code"], "model_not_found");

    let mut texts = Vec::new();
    for model in [MODEL, "sql"] {
        let r = complete(model).send().await.expect("POST");
        assert_eq!(r.status(), reqwest::StatusCode::OK);
        let v: Value = r.json().await.expect("JSON");
        assert_eq!(v["model"], model, "{v}");
        texts.push(v["choices"][0]["text"].as_str().expect("text").to_owned());
    }
    assert_ne!(texts[0], texts[1], "the adapter changed nothing");

    let metrics = c
        .get(server.url("/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("text");
    let ok = format!(
        "{MODEL_LABEL}=\"{MODEL}\",{RELEASE_LABEL}=\"r1\",{OUTCOME_LABEL}=\"{}\"",
        Outcome::Ok.as_str()
    );
    for (labels, want) in [
        (ok.clone(), "1"),
        (format!("{ok},{ADAPTER_LABEL}=\"sql\""), "1"),
    ] {
        let series = format!("{}{{{labels}}}", counter_total(REQUESTS));
        let got = metrics
            .lines()
            .find_map(|l| l.strip_prefix(&series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("{series} not in /metrics:\n{metrics}"));
        assert_eq!(got, want, "{series}");
    }
}

/// Runs `serve` with `extra` flags, which must fail at start-up; returns the exit
/// code and the last line of stderr.
fn refused(extra: &[&str]) -> (Option<i32>, String) {
    let mut command = EngineProcess::command(&serve_args());
    command.args(extra);
    let (status, stderr) = testing::refused(command);
    let last = stderr.lines().last().unwrap_or_default().to_owned();
    (status.code(), last)
}

/// An adapter for SmolLM2's layer 0 whose `attn_q` pair is `[in, a_rank]` ×
/// `[b_rank, out]`.
fn write_adapter(path: &Path, q_a: [u64; 2], q_b: [u64; 2]) {
    let n = |d: [u64; 2]| vec![0.01f32; (d[0] * d[1]) as usize];
    let bytes = GgufWriter::new()
        .metadata("general.architecture", Meta::String("llama".into()))
        .metadata("general.type", Meta::String("adapter".into()))
        .metadata("adapter.type", Meta::String("lora".into()))
        .metadata("adapter.lora.alpha", Meta::F32(8.0))
        .tensor_f32("blk.0.attn_q.weight.lora_a", &q_a, &n(q_a))
        .tensor_f32("blk.0.attn_q.weight.lora_b", &q_b, &n(q_b))
        .to_bytes();
    std::fs::write(path, bytes).expect("write adapter");
}

#[test]
fn start_up_refuses_each_adapter_problem_with_its_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let adapter = lora_adapter_path();
    let rank = dir.path().join("rank.gguf");
    write_adapter(&rank, [576, 8], [4, 576]);
    let dims = dir.path().join("dims.gguf");
    write_adapter(&dims, [576, 8], [8, 192]);
    let good_small = dir.path().join("small.gguf");
    write_adapter(&good_small, [576, 8], [8, 576]);
    let model = model_path();
    let cases: Vec<(Vec<String>, i32, &str)> = vec![
        (
            vec![
                "--lora".into(),
                lora_flag("sql", &adapter),
                "--lora-sha256".into(),
                format!("sql={}", "0".repeat(64)),
            ],
            slipway_contract::exit::MODEL_REJECTED,
            "failed verification",
        ),
        (
            vec!["--lora".into(), lora_flag("sql", &model)],
            slipway_contract::exit::FAILURE,
            "not a LoRA adapter: general.type is",
        ),
        (
            vec!["--lora".into(), lora_flag("sql", &rank)],
            slipway_contract::exit::FAILURE,
            "lora_a has rank 8, lora_b has rank 4",
        ),
        (
            vec!["--lora".into(), lora_flag("sql", &dims)],
            slipway_contract::exit::FAILURE,
            "blk.0.attn_q.weight.lora_b has shape [8, 192]",
        ),
        (
            vec!["--lora".into(), lora_flag(MODEL, &good_small)],
            slipway_contract::exit::FAILURE,
            "the base model's served name",
        ),
        (
            vec![
                "--lora".into(),
                lora_flag("sql", &good_small),
                "--device".into(),
                "cuda".into(),
            ],
            slipway_contract::exit::FAILURE,
            "LoRA adapters need --device cpu",
        ),
    ];
    for (flags, code, reason) in cases {
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let (got, last) = refused(&flags);
        assert_eq!(got, Some(code), "{flags:?}: {last}");
        assert!(
            last.starts_with("Error: ") && last.contains(reason),
            "{flags:?}: expected {reason:?} in the last line, got {last:?}"
        );
        if !reason.starts_with("LoRA adapters need") {
            assert!(last.contains("LoRA adapter \""), "{last}");
        }
    }
}
