//! The release bundle's text side through `slipway-engine serve` as a real process on
//! the real model: `--tokenizer` with a `tokenizer.json` made from the GGUF
//! (`slipway-engine tokenizer-json`, what `engine/scripts/make-tokenizer-json` runs)
//! answers exactly as the GGUF's own vocabulary does; `--chat-template` renders chats
//! as minijinja renders that template; and the start-up checks (a template that
//! cannot render a system and a user message, a tokenizer too large for the
//! embedding, a tokenizer failing its sha256) end the process with the reason.
//!
//! A missing model fails with instructions, never skips. One server at a time.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use sha2::Digest as _;
use slipway_contract::{ServeArgs, exit};
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::template::{ChatMessage, ChatTemplate, RenderOptions, TemplateError};
use slipway_engine::testing::{
    EngineProcess, engine_binary, model_path, read_sse, refused, serve_args,
};
use slipway_engine::tokenizer::Tokenizer;

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const MODEL: &str = "smol";

/// `serve` on the test model, a free port, and `extra` flags.
fn serve(extra: &[&str]) -> Command {
    let mut command = EngineProcess::command(&ServeArgs {
        max_model_len: Some(1024),
        kv_blocks: Some(256),
        ..serve_args(MODEL)
    });
    command.args(extra);
    command
}

/// The GGUF vocabulary as a `tokenizer.json` in `dir`, written by the engine's
/// `tokenizer-json` subcommand.
fn write_tokenizer_json(dir: &Path) -> PathBuf {
    let out = Command::new(engine_binary())
        .arg("tokenizer-json")
        .arg("--model")
        .arg(model_path())
        .output()
        .expect("running slipway-engine tokenizer-json");
    assert!(
        out.status.success(),
        "tokenizer-json failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, &out.stdout).expect("writing tokenizer.json");
    path
}

fn sha256_hex(path: &Path) -> String {
    hex::encode(sha2::Sha256::digest(std::fs::read(path).expect("read")))
}

/// The `Error: ...` line the process ends with.
fn error_line(stderr: &str) -> &str {
    stderr
        .lines()
        .rev()
        .find(|l| l.starts_with("Error: "))
        .unwrap_or_else(|| panic!("no `Error:` line in:\n{stderr}"))
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .expect("client")
}

async fn post(server: &EngineProcess, path: &str, body: &Value) -> Value {
    let resp = client()
        .post(server.url(path))
        .json(body)
        .send()
        .await
        .expect("POST");
    assert_eq!(resp.status(), 200, "{path}");
    resp.json().await.expect("JSON body")
}

/// The text of a streamed chat: the concatenated `delta.content`s.
async fn streamed_chat(server: &EngineProcess, body: &Value) -> String {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let resp = client()
        .post(server.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("POST");
    assert_eq!(resp.status(), 200);
    read_sse(resp, || {})
        .await
        .iter()
        .filter(|p| *p != "[DONE]")
        .map(|p| serde_json::from_str::<Value>(p).expect("JSON chunk"))
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// Greedy answers to a fixed set of requests: per request the text, the prompt
/// token count and, for chats, the streamed text.
async fn answers(server: &EngineProcess) -> Vec<(String, Value, Option<String>)> {
    let chats = [
        "What is the capital of France?",
        "Translate to French: I love 🚀 rockets, 先生, and the year 2024.",
        "Write   three\twords\n\nwith  odd   spacing.",
    ];
    let mut out = Vec::new();
    for content in chats {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": content}],
                          "max_tokens": 40, "temperature": 0});
        let v = post(server, "/v1/chat/completions", &body).await;
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .expect("content")
            .to_owned();
        let streamed = streamed_chat(server, &body).await;
        assert_eq!(
            streamed, text,
            "{content}: streamed and whole answers differ"
        );
        out.push((text, v["usage"].clone(), Some(streamed)));
    }
    let body = json!({"model": MODEL, "prompt": "<|im_start|>user\nList the 3 primary colors.<|im_end|>\n",
                      "max_tokens": 24, "temperature": 0});
    let v = post(server, "/v1/completions", &body).await;
    out.push((
        v["choices"][0]["text"].as_str().expect("text").to_owned(),
        v["usage"].clone(),
        None,
    ));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serve_with_the_generated_tokenizer_json_answers_as_with_the_gguf_vocabulary() {
    let _one = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let tokenizer = write_tokenizer_json(dir.path());
    let sha = sha256_hex(&tokenizer);

    let own = {
        let server = EngineProcess::spawn_command(serve(&[]));
        answers(&server).await
    };
    let bundled = {
        let path = tokenizer.to_str().expect("UTF-8 path");
        let server =
            EngineProcess::spawn_command(serve(&["--tokenizer", path, "--tokenizer-sha256", &sha]));
        answers(&server).await
    };
    assert_eq!(bundled.len(), own.len());
    for (b, o) in bundled.iter().zip(&own) {
        assert!(!o.0.is_empty(), "an empty answer proves nothing");
        assert_eq!(b, o, "--tokenizer changed an answer");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_chat_template_override_is_rendered_as_minijinja_renders_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    // Unlike SmolLM2's own template: no default system message, roles in capitals,
    // BOS/EOS strings from the vocabulary, and a fixed instruction in the prompt.
    let template = "{% for m in messages %}{{ bos_token }}{{ m.role | upper }}\n\
                    {{ m.content | trim }}{{ eos_token }}\n{% endfor %}\
                    {% if add_generation_prompt %}{{ bos_token }}ASSISTANT\nAnswer briefly: {% endif %}";
    let messages = [
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", "  Name a color.  "),
    ];
    let file = GgufFile::open(&model_path()).expect("model");
    let tokenizer = Tokenizer::from_metadata(file.metadata()).expect("tokenizer");
    let rendered = ChatTemplate::with_tokenizer(template, &tokenizer)
        .and_then(|t| t.render(&messages, RenderOptions::default()))
        .expect("the override renders");
    assert_eq!(
        rendered,
        "<|im_start|>SYSTEM\nYou are terse.<|im_end|>\n<|im_start|>USER\nName a color.<|im_end|>\n\
         <|im_start|>ASSISTANT\nAnswer briefly: "
    );
    let own = ChatTemplate::from_metadata(file.metadata(), &tokenizer)
        .and_then(|t| t.render(&messages, RenderOptions::default()))
        .expect("the model's template renders");
    assert_ne!(
        tokenizer.encode(&own).len(),
        tokenizer.encode(&rendered).len()
    );

    let server = EngineProcess::spawn_command(serve(&["--chat-template", template]));
    let chat = post(
        &server,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0}),
    )
    .await;
    let completion = post(
        &server,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": rendered, "max_tokens": 16, "temperature": 0}),
    )
    .await;
    assert_eq!(
        chat["usage"]["prompt_tokens"],
        json!(tokenizer.encode(&rendered).len()),
        "the chat's prompt is not the override's rendering"
    );
    for count in ["prompt_tokens", "completion_tokens"] {
        assert_eq!(chat["usage"][count], completion["usage"][count], "{count}");
    }
    // The completion's prompt found the chat's KV blocks in the prefix cache: the
    // same token ids, block for block (16 positions a block).
    assert_eq!(
        completion["usage"]["prompt_tokens_details"]["cached_tokens"],
        json!(tokenizer.encode(&rendered).len() / 16 * 16)
    );
    assert_eq!(
        chat["choices"][0]["message"]["content"], completion["choices"][0]["text"],
        "the chat continues another prompt than the override's rendering"
    );
}

#[test]
fn broken_chat_templates_are_refused_at_start_up_with_minijinjas_message() {
    let file = GgufFile::open(&model_path()).expect("model");
    let tokenizer = Tokenizer::from_metadata(file.metadata()).expect("tokenizer");
    let cases = [
        // A syntax error: minijinja cannot compile it.
        ("{% for m in messages %}{{ m.content }}", "syntax error"),
        // Compiles, but raises on a system and a user message.
        (
            "{% if messages | length > 1 %}{{ raise_exception('one message only, please') }}\
             {% endif %}{{ messages[0].content }}",
            "one message only, please",
        ),
        // Compiles, but fails on an undefined attribute of a message.
        ("{{ messages[0].content.nope.deeper }}", "undefined"),
    ];
    for (template, fragment) in cases {
        let expected: TemplateError = ChatTemplate::with_tokenizer(template, &tokenizer)
            .and_then(|t| t.render_startup_conversation())
            .expect_err("the template is broken");
        let (status, stderr) = refused(serve(&["--chat-template", template]));
        assert_eq!(status.code(), Some(exit::FAILURE), "{template}\n{stderr}");
        let line = error_line(&stderr);
        assert!(
            line.contains(&expected.to_string()) && line.contains(fragment),
            "{template}: the error should carry minijinja's message ({expected}):\n{line}"
        );
        assert!(line.contains("--chat-template"), "{line}");
    }
}

#[test]
fn a_tokenizer_json_larger_than_the_embedding_is_refused_at_start_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_tokenizer_json(dir.path());
    let mut j: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    j["added_tokens"]
        .as_array_mut()
        .expect("added_tokens")
        .push(
            json!({"id": 49152, "content": "<|extra|>", "single_word": false, "lstrip": false,
                     "rstrip": false, "normalized": false, "special": true}),
        );
    std::fs::write(&path, serde_json::to_vec(&j).unwrap()).unwrap();
    let (status, stderr) = refused(serve(&["--tokenizer", path.to_str().unwrap()]));
    assert_eq!(status.code(), Some(exit::FAILURE), "{stderr}");
    let line = error_line(&stderr);
    assert!(
        line.contains("ids up to 49152") && line.contains("has 49152 rows"),
        "both sizes should be named:\n{line}"
    );
}

#[test]
fn a_tokenizer_json_failing_its_sha256_is_refused_as_not_the_releases() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_tokenizer_json(dir.path());
    let wrong = "0".repeat(64);
    let (status, stderr) = refused(serve(&[
        "--tokenizer",
        path.to_str().unwrap(),
        "--tokenizer-sha256",
        &wrong,
    ]));
    assert_eq!(status.code(), Some(exit::MODEL_REJECTED), "{stderr}");
    let line = error_line(&stderr);
    assert!(
        line.contains("--tokenizer-sha256: tokenizer ")
            && line.contains(&sha256_hex(&path))
            && line.contains("failed verification"),
        "{line}"
    );
}
