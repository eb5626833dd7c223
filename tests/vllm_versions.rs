//! The version table test: every example under deploy/examples with runtime vllm, rendered for
//! every vLLM release of compat/vllm_versions.rs, gets only flags and values that release
//! accepts, or is denied at admission with the release named.

use std::path::PathBuf;

use k8s_openapi::api::core::v1::Container;
use kvfleet::api::{InferenceDeployment, Runtime, VllmEngineSpec};
use kvfleet::compat::vllm_versions::{self, VllmVersion, ATTENTION_BACKEND_ENV};
use kvfleet::compat::{AttentionBackend, KvCacheDtype};
use kvfleet::controller::desired::{desired, Settings};
use kvfleet::validate::{validate_offline, Verdict};

fn vllm_examples() -> Vec<(PathBuf, InferenceDeployment)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/examples");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v: serde_yaml::Value = serde::Deserialize::deserialize(doc).unwrap();
            if v.get("kind").and_then(|k| k.as_str()) != Some("InferenceDeployment") {
                continue;
            }
            let mut o: InferenceDeployment = serde_yaml::from_value(v).unwrap();
            if o.spec.engine.runtime == Runtime::Vllm {
                o.metadata.namespace = Some("ml".into());
                o.metadata.uid = Some("6a1d1c1e-0000-4000-8000-000000000018".into());
                out.push((f.clone(), o));
            }
        }
    }
    out
}

fn verdict_for(o: &InferenceDeployment) -> Verdict {
    let products: Vec<&str> = o
        .spec
        .gpu
        .as_ref()
        .and_then(|g| g.selector.as_ref())
        .map(|s| s.products.iter().map(String::as_str).collect())
        .unwrap_or_default();
    validate_offline(&o.spec, &products).expect("known products")
}

fn at(o: &InferenceDeployment, version: VllmVersion) -> InferenceDeployment {
    let mut o = o.clone();
    o.spec.engine.vllm = Some(VllmEngineSpec {
        version: Some(version.to_string()),
    });
    o
}

fn container(o: &InferenceDeployment, v: &Verdict) -> Container {
    let d = desired(o, v, &Settings::default(), None).expect("renders");
    d.deployment
        .unwrap()
        .spec
        .unwrap()
        .template
        .spec
        .unwrap()
        .containers[0]
        .clone()
}

/// Asserts every flag and value rendered for `version` exists in it.
fn assert_accepted(file: &str, c: &Container, version: VllmVersion, extra: usize) {
    let args = c.args.clone().unwrap();
    let ours = &args[..args.len() - extra];
    let ctx = format!("{file} at vLLM {version}: {ours:?}");
    for (i, a) in ours.iter().enumerate() {
        if !a.starts_with("--") {
            continue;
        }
        assert_eq!(vllm_versions::flag_at(a, version), Some(true), "{a} ({ctx})");
        let value = ours.get(i + 1).cloned().unwrap_or_default();
        match a.as_str() {
            "--kv-cache-dtype" => {
                let d: KvCacheDtype = value.parse().unwrap();
                assert!(vllm_versions::kv_dtype_availability(d).at(version), "{d} ({ctx})");
            }
            "--attention-backend" => {
                let b: AttentionBackend = value.parse().unwrap();
                assert!(vllm_versions::backend_availability(b).at(version), "{b} ({ctx})");
            }
            _ => {}
        }
    }
    let env: Vec<_> = c.env.clone().unwrap_or_default();
    let env_backend = env.iter().find(|e| e.name == ATTENTION_BACKEND_ENV);
    if let Some(e) = env_backend {
        assert!(
            vllm_versions::ATTENTION_BACKEND_ENV_AVAILABILITY.at(version),
            "{ATTENTION_BACKEND_ENV} rendered for a release without it ({ctx})"
        );
        let b: AttentionBackend = e.value.clone().unwrap().parse().unwrap();
        assert!(vllm_versions::backend_availability(b).at(version), "{b} ({ctx})");
    }
    assert!(
        !(env_backend.is_some() && ours.iter().any(|a| a == "--attention-backend")),
        "the backend is chosen once ({ctx})"
    );
}

#[test]
fn every_vllm_example_renders_only_what_each_release_accepts_or_is_denied_naming_the_release() {
    let examples = vllm_examples();
    assert!(examples.len() >= 4, "vLLM examples: {}", examples.len());
    let mut rendered = 0;
    let mut denied_for_release = 0;
    for (file, o) in &examples {
        let file = file.file_name().unwrap().to_string_lossy().to_string();
        let at_default = verdict_for(&at(o, vllm_versions::DEFAULT_VERSION));
        for release in vllm_versions::RELEASES {
            let version = release.version;
            let spec = at(o, version);
            let v = verdict_for(&spec);
            if v.allowed() {
                let c = container(&spec, &v);
                assert_accepted(&file, &c, version, o.spec.engine.extra_args.len());
                rendered += 1;
            } else if at_default.allowed() {
                // Admitted on the default release, denied on this one: the release is why.
                let named = v.denials.iter().any(|d| d.message.contains(&version.to_string()));
                assert!(
                    named,
                    "{file} at {version}: denied without naming the release: {:#?}",
                    v.denials
                );
                denied_for_release += 1;
            }
        }
    }
    assert!(
        rendered > 0 && denied_for_release > 0,
        "rendered {rendered}, denied {denied_for_release}"
    );
}

#[test]
fn nvfp4_on_b200_is_denied_before_0_21_and_rendered_with_the_flag_from_it() {
    let (_, o) = vllm_examples()
        .into_iter()
        .find(|(f, _)| f.ends_with("nvfp4-b200.yaml"))
        .expect("example");
    let old = verdict_for(&at(&o, VllmVersion::parse("0.11.0").unwrap()));
    let d = old
        .denials
        .iter()
        .find(|d| d.field == "spec.engine.kvCacheDtype")
        .unwrap_or_else(|| panic!("{:#?}", old.denials));
    for text in [
        "nvfp4 needs vLLM >= 0.21.0",
        "runs vLLM 0.11.0",
        "use image vllm/vllm-openai:v0.29.0",
    ] {
        assert!(d.message.contains(text), "{text:?} not in {:?}", d.message);
    }
    let spec = at(&o, VllmVersion::parse("0.21.0").unwrap());
    let v = verdict_for(&spec);
    assert!(v.allowed(), "{:#?}", v.denials);
    let c = container(&spec, &v);
    let args = c.args.unwrap();
    let i = args
        .iter()
        .position(|a| a == "--attention-backend")
        .expect("flag from 0.12");
    assert_eq!(args[i + 1], "FLASHINFER");
    assert!(c.env.unwrap().iter().all(|e| e.name != ATTENTION_BACKEND_ENV));
}

#[test]
fn before_0_12_an_explicit_backend_goes_to_the_environment_variable() {
    let (_, o) = vllm_examples()
        .into_iter()
        .find(|(f, _)| f.ends_with("mixed-pool-fp8-sm90-only.yaml"))
        .expect("example");
    let spec = at(&o, VllmVersion::parse("0.11.0").unwrap());
    let v = verdict_for(&spec);
    assert!(v.allowed(), "{:#?}", v.denials);
    let backend = v.resolved.as_ref().unwrap().attention_backend;
    assert_ne!(backend.as_str(), "auto");
    let c = container(&spec, &v);
    assert!(!c.args.unwrap().iter().any(|a| a == "--attention-backend"));
    let env = c.env.unwrap();
    let e = env
        .iter()
        .find(|e| e.name == ATTENTION_BACKEND_ENV)
        .expect("env var");
    assert_eq!(e.value.as_deref(), Some(backend.as_str()));
}

#[test]
fn an_image_without_a_release_tag_is_denied_until_the_version_is_named() {
    let (_, mut o) = vllm_examples().into_iter().next().unwrap();
    o.spec.engine.image = Some("registry.example/team/vllm:prod".into());
    o.spec.engine.vllm = None;
    let v = verdict_for(&o);
    let d = v
        .denials
        .iter()
        .find(|d| d.field == "spec.engine.vllm.version")
        .unwrap_or_else(|| panic!("{:#?}", v.denials));
    assert!(
        d.message.contains("set spec.engine.vllm.version"),
        "{}",
        d.message
    );
    o.spec.engine.vllm = Some(VllmEngineSpec {
        version: Some("0.21.1".into()),
    });
    let v = verdict_for(&o);
    assert!(
        v.denials.iter().all(|d| d.field != "spec.engine.vllm.version"),
        "{:#?}",
        v.denials
    );
}
