//! The forward pass on the real SmolLM2-135M-Instruct Q4_1 against llama.cpp's
//! reference outputs (`shared/oracle`), and batched steps against single-sequence
//! ones. A missing model fails with instructions (`make model`), never skips.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use slipway_engine::backend::cpu::{CpuBackend, CpuConfig};
use slipway_engine::backend::{Batch, LogitsWanted, ModelRunner, SeqChunk};
use slipway_engine::generate::{generate, score};
use slipway_engine::kv::BlockAllocator;
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::model::llama::LlamaWeights;
use slipway_engine::sampling::{Sampler, SamplingParams, argmax};
use slipway_engine::testing::{model_path, oracle};
use slipway_engine::tokenizer::Tokenizer;

#[path = "support/agreement.rs"]
mod agreement;

const BLOCKS: usize = 512;

struct Fixture {
    runner: CpuBackend,
    alloc: BlockAllocator,
    tokenizer: Tokenizer,
}

fn fixture() -> MutexGuard<'static, Fixture> {
    static F: OnceLock<Mutex<Fixture>> = OnceLock::new();
    let m = F.get_or_init(|| {
        let path = model_path();
        let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let weights = Arc::new(
            LlamaWeights::from_gguf(&file)
                .unwrap_or_else(|e| panic!("loading {}: {e}", path.display())),
        );
        let runner = CpuBackend::new(
            weights,
            &CpuConfig {
                num_blocks: BLOCKS,
                ..CpuConfig::default()
            },
        )
        .expect("backend");
        let tokenizer = Tokenizer::from_metadata(file.metadata()).expect("tokenizer");
        Mutex::new(Fixture {
            runner,
            alloc: BlockAllocator::new(BLOCKS),
            tokenizer,
        })
    });
    // A failed test poisons the lock; the fixture itself is still consistent.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn teacher_forced_agreement_with_llama_cpp() {
    let oracle = oracle();
    let mut f = fixture();
    let f = &mut *f;
    let Fixture {
        runner,
        alloc,
        tokenizer,
    } = f;
    agreement::assert_agrees("the base model", &oracle, tokenizer, |tokens| {
        score(runner, alloc, tokens, 1).expect("score")
    });
}

#[test]
fn greedy_matches_llama_cpp_on_safe_prefixes() {
    let oracle = oracle();
    let mut f = fixture();
    let f = &mut *f;
    for p in oracle.prompts.iter().filter(|p| p.safe_prefix > 0) {
        let mut sampler = Sampler::new(SamplingParams::default());
        let out = generate(
            &mut f.runner,
            &mut f.alloc,
            &p.prompt_tokens,
            p.safe_prefix,
            &mut sampler,
            &[],
        )
        .expect("generate");
        assert_eq!(
            out,
            p.continuation[..p.safe_prefix],
            "{}: greedy tokens differ within the safe prefix",
            p.id
        );
    }
}

/// Runs `prompts` one at a time: prefill (logits for every position), then `steps`
/// greedy decode steps. Returns every logits row and the greedy tokens.
fn alone(f: &mut Fixture, prompt: &[u32], steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let bs = f.runner.kv_geometry().block_size;
    let mut table = Vec::new();
    f.alloc
        .ensure(&mut table, prompt.len() + steps, bs)
        .expect("blocks");
    let mut rows = Vec::new();
    let mut toks = Vec::new();
    let out = f
        .runner
        .forward(&Batch {
            seqs: vec![SeqChunk {
                tokens: prompt.to_vec(),
                start_pos: 0,
                block_table: table.clone(),
                logits: LogitsWanted::All,
                adapter: None,
            }],
        })
        .expect("forward");
    rows.extend(out.rows_of(0).map(<[f32]>::to_vec));
    for s in 0..steps {
        let next = argmax(rows.last().expect("row")) as u32;
        toks.push(next);
        let out = f
            .runner
            .forward(&Batch {
                seqs: vec![SeqChunk {
                    tokens: vec![next],
                    start_pos: prompt.len() + s,
                    block_table: table.clone(),
                    logits: LogitsWanted::All,
                    adapter: None,
                }],
            })
            .expect("forward");
        rows.extend(out.rows_of(0).map(<[f32]>::to_vec));
    }
    f.alloc.release(&table).expect("release");
    (rows, toks)
}

#[test]
fn batched_steps_equal_single_sequence_steps() {
    let oracle = oracle();
    let mut prompts: Vec<Vec<u32>> = oracle
        .prompts
        .iter()
        .map(|p| p.prompt_tokens.clone())
        .collect();
    // Sixteen sequences of mixed lengths: the oracle prompts plus two cut ones.
    prompts.push(oracle.prompts[9].prompt_tokens[..61].to_vec());
    prompts.push(oracle.prompts[1].prompt_tokens[..2].to_vec());
    prompts.truncate(16);
    assert_eq!(prompts.len(), 16);
    let steps = 3;
    let mut f = fixture();
    let f = &mut *f;
    let singles: Vec<_> = prompts.iter().map(|p| alone(f, p, steps)).collect();

    // Batched: the first half starts prefilling at step 0 (in two chunks when long),
    // the second half joins one step later, so every step mixes prefill chunks with
    // decode tokens of other sequences.
    let bs = f.runner.kv_geometry().block_size;
    struct St {
        table: Vec<u32>,
        fed: usize,
        rows: Vec<Vec<f32>>,
        toks: Vec<u32>,
    }
    let mut st: Vec<St> = prompts
        .iter()
        .map(|p| {
            let mut table = Vec::new();
            f.alloc
                .ensure(&mut table, p.len() + steps, bs)
                .expect("blocks");
            St {
                table,
                fed: 0,
                rows: Vec::new(),
                toks: Vec::new(),
            }
        })
        .collect();
    for step in 0.. {
        let mut batch = Batch::default();
        let mut members = Vec::new();
        for (i, (p, s)) in prompts.iter().zip(&st).enumerate() {
            if step == 0 && i >= 8 || s.toks.len() == steps {
                continue;
            }
            let chunk = if s.fed < p.len() {
                let n = (p.len() - s.fed).min(40);
                p[s.fed..s.fed + n].to_vec()
            } else {
                vec![*s.toks.last().unwrap_or(&0)]
            };
            batch.seqs.push(SeqChunk {
                tokens: chunk,
                start_pos: s.fed,
                block_table: s.table.clone(),
                logits: LogitsWanted::All,
                adapter: None,
            });
            members.push(i);
        }
        if members.is_empty() {
            break;
        }
        let out = f.runner.forward(&batch).expect("batched forward");
        for (k, &i) in members.iter().enumerate() {
            let s = &mut st[i];
            s.fed += batch.seqs[k].tokens.len();
            s.rows.extend(out.rows_of(k).map(<[f32]>::to_vec));
            if s.fed >= prompts[i].len() {
                s.toks.push(argmax(s.rows.last().expect("row")) as u32);
            }
        }
    }
    for (i, (s, (rows, toks))) in st.iter().zip(&singles).enumerate() {
        assert_eq!(
            &s.toks, toks,
            "sequence {i}: greedy tokens differ in a batch"
        );
        assert_eq!(s.rows.len() + 1, rows.len(), "sequence {i}: row count");
        for (r, (a, b)) in s.rows.iter().zip(rows).enumerate() {
            let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(d <= 1e-3, "sequence {i} row {r}: logits differ by {d}");
        }
    }
    for s in &st {
        f.alloc.release(&s.table).expect("release");
    }
}
