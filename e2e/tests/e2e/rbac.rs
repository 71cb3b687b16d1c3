//! The operator's RBAC identity on the real API server: what its role allows
//! works, what it does not is refused with 403, and the audit log says so.

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::{DynamicObject, ListParams};
use slipway_e2e::crd;
use slipway_e2e::rbac::OperatorIdentity;

use crate::support::{TestContext, inference_services};

pub async fn operator_identity_is_denied_outside_its_role_and_audited(
    context: TestContext,
) -> anyhow::Result<()> {
    crd::ensure_installed(&context.cluster)?;
    let admin = context.admin().await?;
    let namespace = context.namespace(&admin).await?;
    let operator = OperatorIdentity::bind(&context.cluster, &admin, &namespace)
        .await
        .context("binding the operator's ServiceAccount")?;
    let as_operator = operator.client().await?;

    // Granted by manifests/rbac: reading InferenceServices.
    let listed: kube::core::ObjectList<DynamicObject> =
        inference_services(&as_operator, namespace.name())
            .list(&ListParams::default())
            .await
            .context("the operator may list InferenceServices")?;
    ensure!(
        listed.items.is_empty(),
        "a fresh namespace holds InferenceServices"
    );

    // Not granted: reading Secrets.
    let denied = Api::<Secret>::namespaced(as_operator, namespace.name())
        .list(&ListParams::default())
        .await;
    match &denied {
        Err(kube::Error::Api(status)) if status.code == 403 => {}
        other => anyhow::bail!("listing Secrets as the operator was not forbidden: {other:?}"),
    }

    let forbidden = operator
        .wait_for_forbidden(slipway_e2e::wait::DEFAULT_TIMEOUT)
        .await?;
    ensure!(
        forbidden.iter().any(|event| event
            .object_ref
            .as_ref()
            .and_then(|object| object.resource.as_deref())
            == Some("secrets")
            && event.verb == "list"),
        "the audit log has 403s for {}, but none for listing secrets: {forbidden:#?}",
        operator.username()
    );
    ensure!(
        forbidden.iter().all(|event| event
            .object_ref
            .as_ref()
            .and_then(|o| o.resource.as_deref())
            == Some("secrets")),
        "the operator was denied something its role should allow: {forbidden:#?}"
    );
    Ok(())
}
