use super::*;

fn config() -> AdmissionConfig {
    AdmissionConfig {
        max_num_seqs: 4,
        max_queue: 4,
        kv_budget_blocks: 100,
        block_size: 16,
        queue_deadline: Duration::from_secs(10),
        tenant_rate: None,
    }
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

#[test]
fn cost_counts_prompt_and_max_tokens_in_blocks() {
    assert_eq!(
        cost(10, 6, 16),
        Cost {
            tokens: 16,
            blocks: 1
        }
    );
    assert_eq!(
        cost(10, 7, 16),
        Cost {
            tokens: 17,
            blocks: 2
        }
    );
}

#[test]
fn capacity_checks_in_order_with_retry_estimates() {
    let c = config();
    let small = cost(16, 16, 16);
    let idle = Load::default();
    assert_eq!(check(&c, &idle, small), Ok(()));
    // Larger than the whole budget: never, and no Retry-After.
    let huge = cost(2000, 2000, 16);
    let e = check(&c, &idle, huge).expect_err("never fits");
    assert!(matches!(
        e,
        Rejection::NeverFits {
            need: 250,
            budget: 100
        }
    ));
    assert_eq!(e.retry_after(), None);

    // Queue full: 8 in flight (4 running + 4 queued); 4 s per request, 4 at once:
    // one place frees in about 1 s.
    let full = Load {
        in_flight: 8,
        reserved_blocks: 16,
        service_time: Some(secs(4.0)),
    };
    let e = check(&c, &full, small).expect_err("queue full");
    assert!(
        matches!(e, Rejection::QueueFull { in_flight: 8, .. }),
        "{e:?}"
    );
    assert_eq!(e.retry_after(), Some(secs(1.0)));

    // KV committed: 4 requests hold 96 blocks (24 each); 6 more blocks need one of
    // them to finish.
    let kv = Load {
        in_flight: 4,
        reserved_blocks: 96,
        service_time: Some(secs(4.0)),
    };
    let e = check(&c, &kv, cost(50, 46, 16)).expect_err("kv");
    assert!(matches!(e, Rejection::KvBudget { .. }), "{e:?}");
    assert_eq!(e.retry_after(), Some(secs(1.0)));

    // Deadline: 7 in flight, 40 s per request: the 8th waits (8-4)·40/4 = 40 s > 10 s.
    let slow = Load {
        in_flight: 7,
        reserved_blocks: 14,
        service_time: Some(secs(40.0)),
    };
    let e = check(&c, &slow, small).expect_err("deadline");
    assert!(matches!(e, Rejection::Deadline { .. }), "{e:?}");
    assert_eq!(e.retry_after(), Some(secs(30.0)));
    // The same load with fast requests is fine.
    let fast = Load {
        service_time: Some(secs(1.0)),
        ..slow
    };
    assert_eq!(check(&c, &fast, small), Ok(()));
    // Unknown service time: no deadline judgement, a 1 s retry hint.
    let unknown = Load {
        service_time: None,
        ..full
    };
    assert_eq!(
        check(&c, &unknown, small).expect_err("full").retry_after(),
        Some(secs(1.0))
    );
}

#[test]
fn estimated_wait_is_zero_while_a_place_is_free() {
    let c = config();
    let mut l = Load {
        in_flight: 3,
        reserved_blocks: 0,
        service_time: Some(secs(2.0)),
    };
    assert_eq!(estimated_wait(&c, &l), Some(Duration::ZERO));
    l.in_flight = 4;
    assert_eq!(estimated_wait(&c, &l), Some(secs(0.5)));
    l.in_flight = 6;
    assert_eq!(estimated_wait(&c, &l), Some(secs(1.5)));
    l.service_time = None;
    assert_eq!(estimated_wait(&c, &l), None);
}

#[test]
fn retry_after_header_is_whole_seconds_at_least_one() {
    assert_eq!(retry_secs(Duration::ZERO), 1);
    assert_eq!(retry_secs(secs(0.2)), 1);
    assert_eq!(retry_secs(secs(1.0)), 1);
    assert_eq!(retry_secs(secs(1.01)), 2);
}

#[test]
fn token_bucket_refills_at_its_rate_and_caps_at_burst() {
    let r = TenantRate {
        tokens_per_s: 100.0,
        burst: 200.0,
    };
    let mut b = TokenBucket::full(&r, 0.0);
    assert_eq!(b.take(&r, 150, 0.0), Ok(()));
    // 50 left; 100 more need 0.5 s.
    assert_eq!(b.take(&r, 100, 0.0), Err(secs(0.5)));
    assert_eq!(b.take(&r, 100, 0.5), Ok(()));
    // A request bigger than the burst needs a full bucket, not more.
    assert_eq!(b.take(&r, 10_000, 0.5), Err(secs(2.0)));
    assert_eq!(b.take(&r, 10_000, 2.5), Ok(()));
    assert!(!b.is_full(&r, 2.5));
    assert!(b.is_full(&r, 10.0));
}

#[test]
fn permits_hold_and_return_their_share() {
    let a = Admission::new(config()).expect("config");
    let now = Instant::now();
    let c = cost(16, 16, 16);
    let permits: Vec<_> = (0..8)
        .map(|_| a.try_admit(None, c, now).expect("room"))
        .collect();
    assert_eq!(a.load().in_flight, 8);
    assert_eq!(a.load().reserved_blocks, 16);
    assert!(matches!(
        a.try_admit(None, c, now),
        Err(Rejection::QueueFull { .. })
    ));
    permits[0].completed(secs(2.0));
    permits[1].completed(secs(4.0));
    let avg = a.load().service_time.expect("measured");
    assert!((avg.as_secs_f64() - 2.4).abs() < 1e-9, "{avg:?}");
    drop(permits);
    assert_eq!(a.load().in_flight, 0);
    assert_eq!(a.load().reserved_blocks, 0);
    assert!(a.try_admit(None, c, now).is_ok());
}

#[test]
fn tenants_are_limited_separately_and_503s_cost_nothing() {
    let mut cfg = config();
    cfg.tenant_rate = Some(TenantRate {
        tokens_per_s: 10.0,
        burst: 64.0,
    });
    cfg.max_queue = 0;
    let a = Admission::new(cfg).expect("config");
    let now = Instant::now();
    let c = cost(16, 16, 16);
    let p1 = a.try_admit(Some("alice"), c, now).expect("burst");
    let p2 = a.try_admit(Some("alice"), c, now).expect("burst");
    let e = a.try_admit(Some("alice"), c, now).expect_err("over rate");
    assert!(matches!(e, Rejection::TenantRate { .. }), "{e:?}");
    assert_eq!(e.retry_after(), Some(secs(3.2)));
    // Another tenant and anonymous requests are unaffected.
    let p3 = a.try_admit(Some("bob"), c, now).expect("bob");
    let p4 = a.try_admit(None, c, now).expect("anonymous");
    // Now the 4 places are taken: carol is refused for capacity (503) and keeps her
    // bucket full.
    assert!(matches!(
        a.try_admit(Some("carol"), c, now),
        Err(Rejection::QueueFull { .. })
    ));
    drop((p1, p2, p3, p4));
    let _c1 = a.try_admit(Some("carol"), c, now).expect("carol");
    let _c2 = a
        .try_admit(Some("carol"), c, now)
        .expect("carol's full burst");
}

#[test]
fn invalid_configs_are_refused() {
    let mut c = config();
    c.max_num_seqs = 0;
    assert_eq!(
        Admission::new(c).err(),
        Some(AdmissionConfigError::Zero("max_num_seqs"))
    );
    let mut c = config();
    c.kv_budget_blocks = 0;
    assert_eq!(
        Admission::new(c).err(),
        Some(AdmissionConfigError::Zero("kv_budget_blocks"))
    );
    let mut c = config();
    let rate = TenantRate {
        tokens_per_s: 0.0,
        burst: 10.0,
    };
    c.tenant_rate = Some(rate);
    let e = Admission::new(c).err();
    assert_eq!(e, Some(AdmissionConfigError::TenantRate(rate)));
    assert_eq!(
        e.map(|e| e.to_string()).as_deref(),
        Some("tenant rate must be > 0 tokens/s with a burst of at least 1 token, got 0 / 10")
    );
}
