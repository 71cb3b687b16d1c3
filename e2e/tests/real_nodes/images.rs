//! The images the real nodes run are what the Dockerfile describes: for its `engine`,
//! `operator` and `router` stages, the image each node's containerd holds under the name the
//! manifests use has the stage's USER and ENTRYPOINT, was imported from the OCI
//! tarball `e2e/cluster/build-images` wrote (same manifest digest), and that
//! tarball's layer holds the binary at the stage's COPY destination.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use anyhow::{Context as _, bail, ensure};
use serde_json::Value;
use slipway_e2e::manifests::repo_root;
use slipway_e2e::packaging::{self, Rendered};
use slipway_e2e::real_nodes;

use crate::support::{Env, engine_image, fault_injection_image};

/// What a final stage of the Dockerfile says about its image.
#[derive(Debug, Default)]
struct Stage {
    user: Option<String>,
    entrypoint: Option<Value>,
    copy_dest: Option<String>,
}

/// The Dockerfile's stages by name (`FROM <base> AS <name>`), with the last USER,
/// ENTRYPOINT (exec form, JSON) and COPY destination of each.
fn dockerfile_stages(text: &str) -> anyhow::Result<BTreeMap<String, Stage>> {
    let mut stages = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let line = line.trim();
        let Some((instruction, rest)) = line.split_once(char::is_whitespace) else {
            continue;
        };
        let rest = rest.trim();
        match instruction.to_ascii_uppercase().as_str() {
            "FROM" => {
                let words: Vec<&str> = rest.split_whitespace().collect();
                current = match words.as_slice() {
                    [_, as_, name] if as_.eq_ignore_ascii_case("as") => Some((*name).to_owned()),
                    _ => None,
                };
                if let Some(name) = &current {
                    stages.insert(name.clone(), Stage::default());
                }
            }
            "USER" | "ENTRYPOINT" | "COPY" => {
                let Some(stage) = current.as_ref().and_then(|n| stages.get_mut(n)) else {
                    continue;
                };
                match instruction.to_ascii_uppercase().as_str() {
                    "USER" => stage.user = Some(rest.to_owned()),
                    "ENTRYPOINT" => {
                        stage.entrypoint = Some(serde_json::from_str(rest).with_context(|| {
                            format!("ENTRYPOINT {rest} is not the exec (JSON) form")
                        })?);
                    }
                    _ => stage.copy_dest = rest.split_whitespace().last().map(str::to_owned),
                }
            }
            _ => {}
        }
    }
    Ok(stages)
}

/// `manifests/operator/deployment.yaml`.
fn operator_deployment() -> anyhow::Result<Rendered> {
    Ok(Rendered::read(packaging::operator_deployment_file())?)
}

/// The `image:` of the operator's Deployment.
fn operator_image() -> anyhow::Result<String> {
    operator_deployment()?.operator_container()?["image"]
        .as_str()
        .map(str::to_owned)
        .context("the operator's container has no image")
}

/// The router pods' image: the operator's `--router-image` in its Deployment, as the
/// operator reads it.
fn router_image() -> anyhow::Result<String> {
    Ok(operator_deployment()?.operator_args()?.router_image)
}

/// One member of an OCI layout tarball, read with tar(1).
fn tar_member(tarball: &Path, member: &str) -> anyhow::Result<Vec<u8>> {
    let output = Command::new("tar")
        .arg("-xOf")
        .arg(tarball)
        .arg(member)
        .output()
        .context("running tar")?;
    ensure!(
        output.status.success(),
        "tar -xOf {} {member}: {}",
        tarball.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(output.stdout)
}

/// The manifest digest of an OCI layout tarball, and the file names in its one layer.
fn tarball_contents(tarball: &Path) -> anyhow::Result<(String, Vec<String>)> {
    let index: Value = serde_json::from_slice(&tar_member(tarball, "./index.json")?)?;
    let digest = index["manifests"][0]["digest"]
        .as_str()
        .context("index.json names no manifest")?
        .to_owned();
    let blob = |digest: &str| {
        tar_member(
            tarball,
            &format!("./blobs/sha256/{}", digest.trim_start_matches("sha256:")),
        )
    };
    let manifest: Value = serde_json::from_slice(&blob(&digest)?)?;
    let layer = manifest["layers"][0]["digest"]
        .as_str()
        .context("the manifest has no layer")?;
    let layer = blob(layer)?;
    let mut list = Command::new("tar")
        .arg("-t")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("running tar -t")?;
    let mut stdin = list.stdin.take().context("tar's stdin")?;
    let writer = std::thread::spawn(move || stdin.write_all(&layer));
    let output = list.wait_with_output()?;
    match writer.join() {
        Ok(result) => result.context("writing the layer to tar")?,
        Err(_) => bail!("the thread writing the layer panicked"),
    }
    ensure!(output.status.success(), "tar -t of the layer failed");
    let files = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| l.trim_start_matches("./").to_owned())
        .collect();
    Ok((digest, files))
}

pub async fn imported_images_match_the_dockerfile(env: Arc<Env>) -> anyhow::Result<()> {
    let admin = env.cluster.client().await?;
    let nodes = env.cluster.real_nodes(&admin).await?;
    let dockerfile = repo_root().join("Dockerfile");
    let text = std::fs::read_to_string(&dockerfile)
        .with_context(|| format!("reading {}", dockerfile.display()))?;
    let stages = dockerfile_stages(&text)?;
    for (stage_name, image, tarball) in [
        ("engine", engine_image()?, "engine.oci.tar"),
        (
            "engine",
            fault_injection_image()?,
            "engine-fault-injection.oci.tar",
        ),
        ("operator", operator_image()?, "operator.oci.tar"),
        ("router", router_image()?, "router.oci.tar"),
    ] {
        let stage = stages
            .get(stage_name)
            .with_context(|| format!("the Dockerfile has no stage {stage_name}"))?;
        let (user, entrypoint, dest) = match (&stage.user, &stage.entrypoint, &stage.copy_dest) {
            (Some(u), Some(e), Some(d)) => (u, e, d),
            _ => bail!("stage {stage_name} lacks USER, ENTRYPOINT or COPY: {stage:?}"),
        };
        let tarball = real_nodes::images_dir().join(tarball);
        let (built_digest, files) = tarball_contents(&tarball)?;
        let in_layer = dest.trim_start_matches('/');
        ensure!(
            files.iter().any(|f| f == in_layer),
            "{}: the layer has no {dest} (stage {stage_name}'s COPY destination)",
            tarball.display()
        );
        for node in &nodes {
            let (digest, config) = node.image_config(&image)?;
            ensure!(
                digest == built_digest,
                "{}: {image} is {digest}, but {} is {built_digest}",
                node.name(),
                tarball.display()
            );
            let config = &config["config"];
            ensure!(
                config["User"].as_str() == Some(user.as_str()),
                "{}: {image} runs as {}, the Dockerfile's {stage_name} stage as {user}",
                node.name(),
                config["User"]
            );
            ensure!(
                &config["Entrypoint"] == entrypoint,
                "{}: {image}'s entrypoint is {}, the Dockerfile's {stage_name} stage's {entrypoint}",
                node.name(),
                config["Entrypoint"]
            );
            ensure!(
                entrypoint[0].as_str() == Some(dest.as_str()),
                "stage {stage_name}: ENTRYPOINT {entrypoint} does not run the binary COPY puts at {dest}"
            );
        }
    }
    Ok(())
}
