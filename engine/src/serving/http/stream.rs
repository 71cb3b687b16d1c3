//! Turning a request's engine events into an OpenAI response: text by incremental
//! decoding with stop strings held back until they cannot match, then either one
//! JSON body ([`collect`]) or SSE chunks ([`sse`]).
//!
//! A request that fails after it started ends explicitly with its
//! [`RequestError`]'s [`ApiError`]: a 503 (engine shut down, or aborted at the end of
//! the drain's shutdown budget) or 500 (the forward step failed) JSON error when not
//! streaming; the same `error` object, then `[DONE]`, on a stream. Never a silently
//! cut connection.
//!
//! Dropping either (client gone) drops the engine stream, which frees the request's
//! KV before the next step, and the [`Tracker`], which counts it as cancelled.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use futures::Stream;
use serde_json::{Value, json};

use super::errors::ApiError;
use super::openai_types::Prepared;
use super::track::{Tracker, Usage, outcome_of};
use crate::serving::engine::{Event, RequestError, RequestStream};
use crate::serving::metrics::Outcome;
use crate::serving::text::StopMatcher;
use crate::tokenizer::{IncrementalDecoder, Tokenizer};

/// Turns engine events into text pieces and a final state.
pub(super) struct Detok {
    pub(super) tokenizer: Arc<Tokenizer>,
    pub(super) decoder: IncrementalDecoder,
    pub(super) stops: StopMatcher,
}

enum Piece {
    Text(String),
    Done {
        text: String,
        reason: &'static str,
        outcome: Outcome,
        usage: Usage,
    },
    Failed(RequestError),
}

impl Detok {
    fn next(&mut self, e: Option<Event>, done_by_stop: &mut bool) -> Piece {
        match e {
            Some(Event::Token(t)) => {
                let text = self.decoder.push(&self.tokenizer, t).unwrap_or_default();
                let step = self.stops.push(&text);
                if step.stopped {
                    *done_by_stop = true;
                }
                Piece::Text(step.emit)
            }
            Some(Event::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                let mut text = self.decoder.finish();
                text = self.stops.push(&text).emit;
                text.push_str(&self.stops.finish());
                Piece::Done {
                    text,
                    reason: reason.as_str(),
                    outcome: outcome_of(reason),
                    usage: Usage {
                        prompt: prompt_tokens,
                        completion: completion_tokens,
                        cached: cached_tokens,
                    },
                }
            }
            Some(Event::Error(m)) => Piece::Failed(m),
            None => Piece::Failed(RequestError::Shutdown),
        }
    }
}

fn usage_json(u: Usage) -> Value {
    json!({"prompt_tokens": u.prompt, "completion_tokens": u.completion, "total_tokens": u.prompt + u.completion,
           "prompt_tokens_details": {"cached_tokens": u.cached}})
}

/// What identifies the response: its id, creation time and request.
pub(super) struct Meta {
    pub(super) p: Prepared,
    pub(super) id: String,
    pub(super) created: u64,
}

impl Meta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.p.chat, chunk) {
            (true, false) => "chat.completion",
            (true, true) => "chat.completion.chunk",
            (false, _) => "text_completion",
        }
    }

    fn body(&self, text: &str, reason: &str, usage: Value) -> Response {
        let choice = if self.p.chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason, "logprobs": null})
        } else {
            json!({"index": 0, "text": text, "finish_reason": reason, "logprobs": null})
        };
        Json(
            json!({"id": self.id, "object": self.object(false), "created": self.created,
                    "model": self.p.model, "choices": [choice], "usage": usage}),
        )
        .into_response()
    }

    fn chunk(&self, text: Option<&str>, reason: Option<&str>) -> Value {
        let choice = if self.p.chat {
            let delta = text.map_or_else(|| json!({}), |t| json!({"content": t}));
            json!({"index": 0, "delta": delta, "finish_reason": reason, "logprobs": null})
        } else {
            json!({"index": 0, "text": text.unwrap_or(""), "finish_reason": reason, "logprobs": null})
        };
        json!({"id": self.id, "object": self.object(true), "created": self.created,
               "model": self.p.model, "choices": [choice]})
    }
}

/// Waits for the whole answer and returns one JSON body.
pub(super) async fn collect(
    mut stream: RequestStream,
    mut detok: Detok,
    meta: Meta,
    mut tracker: Tracker,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut by_stop = false;
    let mut completion = 0;
    let prompt = meta.p.gen_req.prompt.len();
    let _relaying = tracker.stream_span(false);
    loop {
        let e = stream.events.recv().await;
        if matches!(e, Some(Event::Token(_))) {
            completion += 1;
            tracker.token();
        }
        match detok.next(e, &mut by_stop) {
            Piece::Text(t) => {
                text.push_str(&t);
                if by_stop {
                    // Dropping the stream cancels the request in the engine.
                    drop(stream);
                    let u = Usage {
                        prompt,
                        completion,
                        cached: 0,
                    };
                    tracker.record_usage("stop", u);
                    tracker.finish(Outcome::Ok);
                    return Ok(meta.body(&text, "stop", usage_json(u)));
                }
            }
            Piece::Done {
                text: t,
                reason,
                outcome,
                usage,
            } => {
                text.push_str(&t);
                tracker.record_usage(reason, usage);
                tracker.finish(outcome);
                return Ok(meta.body(&text, reason, usage_json(usage)));
            }
            Piece::Failed(e) => {
                tracker.finish(Outcome::Error);
                return Err(e.into());
            }
        }
    }
}

struct St {
    stream: Option<RequestStream>,
    detok: Detok,
    meta: Meta,
    tracker: Tracker,
    queue: VecDeque<SseEvent>,
    completion: usize,
    started: bool,
    /// Open while the answer is relayed; closed when the stream ends.
    _relaying: tracing::Span,
}

impl St {
    fn push(&mut self, v: &Value) {
        self.queue
            .push_back(SseEvent::default().data(v.to_string()));
    }
}

/// The SSE stream of chunks, ending with `[DONE]` after the finish chunk (and the
/// usage chunk when asked for), or after an `error` object.
pub(super) fn sse(
    stream: RequestStream,
    detok: Detok,
    meta: Meta,
    tracker: Tracker,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let st = St {
        stream: Some(stream),
        detok,
        meta,
        _relaying: tracker.stream_span(true),
        tracker,
        queue: VecDeque::new(),
        completion: 0,
        started: false,
    };
    futures::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.queue.pop_front() {
                return Some((Ok(e), st));
            }
            let rx = st.stream.as_mut()?;
            if st.meta.p.chat && !st.started {
                st.started = true;
                let mut c = st.meta.chunk(None, None);
                c["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
                st.push(&c);
                continue;
            }
            let e = rx.events.recv().await;
            if matches!(e, Some(Event::Token(_))) {
                st.completion += 1;
                st.tracker.token();
            }
            let mut by_stop = false;
            let prompt = st.meta.p.gen_req.prompt.len();
            let (text, end) = match st.detok.next(e, &mut by_stop) {
                Piece::Text(t) if by_stop => (
                    t,
                    Some((
                        "stop",
                        Outcome::Ok,
                        Usage {
                            prompt,
                            completion: st.completion,
                            cached: 0,
                        },
                    )),
                ),
                Piece::Text(t) => (t, None),
                Piece::Done {
                    text,
                    reason,
                    outcome,
                    usage,
                } => (text, Some((reason, outcome, usage))),
                Piece::Failed(e) => {
                    st.stream = None;
                    st.tracker.finish(Outcome::Error);
                    st.push(&ApiError::from(e).body());
                    st.queue.push_back(SseEvent::default().data("[DONE]"));
                    continue;
                }
            };
            if !text.is_empty() {
                let c = st.meta.chunk(Some(&text), None);
                st.push(&c);
            }
            if let Some((reason, outcome, usage)) = end {
                // Dropping the engine stream ends (or, on a stop string, cancels) it.
                st.stream = None;
                st.tracker.record_usage(reason, usage);
                st.tracker.finish(outcome);
                let c = st.meta.chunk(None, Some(reason));
                st.push(&c);
                if st.meta.p.include_usage {
                    let mut u = json!({"id": st.meta.id, "object": st.meta.object(true),
                                       "created": st.meta.created, "model": st.meta.p.model, "choices": []});
                    u["usage"] = usage_json(usage);
                    st.push(&u);
                }
                st.queue.push_back(SseEvent::default().data("[DONE]"));
            }
        }
    })
}
