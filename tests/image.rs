//! The container image. `image/build --flavour cpu` makes the image from this test's kvfleet
//! binary without pulling any base image (mmdebstrap + buildah); the test then unpacks the OCI
//! archive and runs it the way a container runtime would with the chart's security context:
//! the image's user (65532), environment and working directory, a read-only root filesystem and
//! a tmpfs on /tmp, in its own mount and PID namespaces. Inside it `kvfleet --version`,
//! `kvfleet check` on an example and `kvfleet worker` on the embedded model answering a chat
//! request must work. Needs root (mmdebstrap, buildah, chroot) and the Debian mirror;
//! `.ci/install-tools` installs the builders. About 2 minutes, most of it mmdebstrap (the root
//! filesystem tar is cached in target/image/).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

mod tools_support;
use tools_support::find_tool;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

fn helm() -> PathBuf {
    find_tool(
        "KVFLEET_HELM",
        "helm",
        "run `.ci/install-tools` and export the environment it prints",
    )
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

// === the built image, once per test binary ===

/// The unpacked cpu-flavour image: its root filesystem and its OCI config.
struct Image {
    archive: PathBuf,
    rootfs: PathBuf,
    index: Value,
    config: Value,
    layers: Vec<(u64, u64)>,
    build_seconds: f64,
}

fn image() -> &'static Image {
    static IMAGE: OnceLock<Image> = OnceLock::new();
    IMAGE.get_or_init(|| build_and_unpack("cpu"))
}

fn gpu_image() -> &'static Image {
    static IMAGE: OnceLock<Image> = OnceLock::new();
    IMAGE.get_or_init(|| build_and_unpack("gpu"))
}

fn build_and_unpack(flavour: &str) -> Image {
    let uid = Command::new("id").arg("-u").output().expect("cannot run id");
    assert_eq!(
        String::from_utf8_lossy(&uid.stdout).trim(),
        "0",
        "the image test needs root (mmdebstrap, buildah with vfs storage, chroot): run it as root, \
         e.g. `sudo -E cargo test --test image`"
    );
    let dir = repo().join("target/image-test").join(flavour);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let archive = dir.join(format!("kvfleet-{flavour}.oci.tar"));
    let started = Instant::now();
    let out = Command::new(repo().join("image/build"))
        .args([
            "--flavour",
            flavour,
            "--binary",
            env!("CARGO_BIN_EXE_kvfleet"),
            "--out",
        ])
        .arg(&archive)
        .output()
        .expect("cannot run image/build");
    let build_seconds = started.elapsed().as_secs_f64();
    assert!(
        out.status.success(),
        "image/build --flavour {flavour} failed (tools: run .ci/install-tools):\n{}",
        text(&out)
    );
    eprintln!("{}", String::from_utf8_lossy(&out.stderr).trim_end());

    // Unpack the archive as a runtime does: index -> manifest -> config + layers in order.
    let oci = dir.join("oci");
    let rootfs = dir.join("rootfs");
    std::fs::create_dir_all(&oci).unwrap();
    std::fs::create_dir_all(&rootfs).unwrap();
    run_ok(Command::new("tar").arg("-xf").arg(&archive).arg("-C").arg(&oci));
    let read_json = |p: PathBuf| -> Value {
        serde_json::from_slice(&std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
    };
    let blob = |digest: &str| {
        oci.join("blobs/sha256")
            .join(digest.trim_start_matches("sha256:"))
    };
    let index = read_json(oci.join("index.json"));
    let manifest = read_json(blob(
        index["manifests"][0]["digest"].as_str().expect("manifest digest"),
    ));
    let config = read_json(blob(
        manifest["config"]["digest"].as_str().expect("config digest"),
    ));
    let mut layers = Vec::new();
    for layer in manifest["layers"].as_array().expect("layers") {
        assert_eq!(
            layer["mediaType"], "application/vnd.oci.image.layer.v1.tar+gzip",
            "layers are gzip-compressed"
        );
        let path = blob(layer["digest"].as_str().unwrap());
        let listing = run_ok(Command::new("tar").arg("-tzf").arg(&path));
        assert!(
            !String::from_utf8_lossy(&listing.stdout).contains(".wh."),
            "a layer holds whiteouts, which this unpacker does not apply"
        );
        run_ok(
            Command::new("tar")
                .args(["-xzf"])
                .arg(&path)
                .args(["--numeric-owner", "-C"])
                .arg(&rootfs),
        );
        let unpacked = run_ok(
            Command::new("sh")
                .arg("-c")
                .arg(format!("gzip -dc '{}' | wc -c", path.display())),
        );
        layers.push((
            layer["size"].as_u64().unwrap(),
            String::from_utf8_lossy(&unpacked.stdout).trim().parse().unwrap(),
        ));
    }
    Image {
        archive,
        rootfs,
        index,
        config,
        layers,
        build_seconds,
    }
}

fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed:\n{}", text(&out));
    out
}

/// The mounts a runtime with `readOnlyRootFilesystem: true` and an emptyDir on /tmp gives a
/// container, then the image's user, environment and working directory, then ARGS.
const SANDBOX: &str = r#"
set -eu
r="$1"; examples="$2"; user="$3"; workdir="$4"; shift 4
mount --make-rprivate /
mount --bind "$r" "$r"
mount -o remount,bind,ro "$r"
mount -t proc proc "$r/proc"
mount -t tmpfs -o mode=1777 tmpfs "$r/tmp"
mount -t tmpfs -o mode=755 tmpfs "$r/dev"
for d in null zero random urandom; do touch "$r/dev/$d"; mount --bind "/dev/$d" "$r/dev/$d"; done
mount --bind -o ro "$examples" "$r/mnt"
chroot --userspec="$user" "$r" /usr/bin/env -i -C "$workdir" "$@" &
wait $!
"#;

/// A command run inside the image; the `unshare --pid --kill-child` parent takes every process
/// of it down when dropped.
fn in_image(args: &[&str]) -> Command {
    in_this_image(image(), args)
}

fn in_this_image(img: &Image, args: &[&str]) -> Command {
    let cfg = &img.config["config"];
    let mut cmd = Command::new("unshare");
    cmd.args([
        "--mount",
        "--pid",
        "--fork",
        "--kill-child=SIGKILL",
        "--",
        "sh",
        "-c",
        SANDBOX,
        "sandbox",
    ])
    .arg(&img.rootfs)
    .arg(repo().join("deploy/examples"))
    .arg(cfg["User"].as_str().expect("image user"))
    .arg(cfg["WorkingDir"].as_str().expect("image working directory"));
    for e in cfg["Env"].as_array().expect("image env") {
        cmd.arg(e.as_str().unwrap());
    }
    cmd.args(args);
    cmd
}

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn http(port: u16, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(300))).ok()?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split(' ').nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

// === tests: the image runs ===

#[test]
fn cpu_image_runs_version_check_and_the_embedded_model_as_uid_65532_on_a_read_only_root() {
    let img = image();
    let archive_mib = std::fs::metadata(&img.archive).unwrap().len() as f64 / 1048576.0;
    let unpacked_mib = img.layers.iter().map(|l| l.1).sum::<u64>() as f64 / 1048576.0;
    eprintln!(
        "image kvfleet:{}-cpu: archive {archive_mib:.1} MiB, unpacked {unpacked_mib:.1} MiB, \
         layers (compressed, unpacked bytes) {:?}, built in {:.0} s",
        version(),
        img.layers,
        img.build_seconds
    );

    // The user, and which places are writable.
    let out = run_ok(&mut in_image(&[
        "/bin/sh",
        "-c",
        "id -u; id -g; touch /opt/kvfleet/probe 2>&1 || true; touch /tmp/probe && echo tmp-writable",
    ]));
    let shown = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = shown.lines().collect();
    assert_eq!(&lines[..2], ["65532", "65532"], "{shown}");
    assert!(shown.contains("Read-only file system"), "{shown}");
    assert!(shown.contains("tmp-writable"), "{shown}");

    // kvfleet --version
    let out = run_ok(&mut in_image(&["kvfleet", "--version"]));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("kvfleet {}", version())
    );

    // kvfleet check on examples (deploy/examples mounted at /mnt): admitted on H100 nodes (exit
    // 0); nvfp4 KV on an RTX PRO 6000 (sm_120) denied with the fix (exit 1).
    let out = in_image(&[
        "kvfleet",
        "check",
        "-f",
        "/mnt/llama-3.1-8b-h100.yaml",
        "--nodes",
        "/mnt/nodes/h100.yaml",
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("): admitted"), "{}", text(&out));
    let out = in_image(&["kvfleet", "check", "-f", "/mnt/nvfp4-rtx-pro-6000.yaml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("): denied"), "{}", text(&out));

    // kvfleet worker with no model flags: the embedded SmolLM2 from the image answers a chat.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log = img.archive.with_file_name("worker.log");
    let child = in_image(&["kvfleet", "worker", "--listen", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut worker = Running(child);
    let deadline = Instant::now() + Duration::from_secs(180);
    while http(port, "GET", "/readyz", "").map(|r| r.0) != Some(200) {
        if let Ok(Some(status)) = worker.0.try_wait() {
            panic!(
                "the worker exited ({status}) in the image:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "the worker in the image was not ready within 180 s:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let body = r#"{"model":"SmolLM2-135M-Instruct","temperature":0,"max_tokens":16,
        "messages":[{"role":"user","content":"What is the capital of France?"}]}"#;
    let (status, reply) = http(port, "POST", "/v1/chat/completions", body).expect("no reply");
    assert_eq!(status, 200, "{reply}");
    let v: Value = serde_json::from_str(&reply).unwrap();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap_or_default();
    assert!(content.contains("Paris"), "greedy reply: {content:?}");
    let _ = worker.0.kill();
    let _ = worker.0.wait();
}

#[test]
fn image_config_is_non_root_labelled_and_matches_the_containerfile() {
    let img = image();
    let tag = format!("kvfleet:{}-cpu", version());
    let annotations = &img.index["manifests"][0]["annotations"];
    assert_eq!(annotations["org.opencontainers.image.ref.name"], tag.as_str());
    assert_eq!(
        annotations["io.containerd.image.name"],
        format!("docker.io/library/{tag}").as_str()
    );

    let cfg = &img.config["config"];
    assert_eq!(cfg["User"], "65532:65532");
    assert_eq!(cfg["WorkingDir"], "/opt/kvfleet");
    assert_eq!(cfg["Entrypoint"], serde_json::json!(["/usr/local/bin/kvfleet"]));
    let labels = &cfg["Labels"];
    assert_eq!(labels["org.opencontainers.image.version"], version());
    assert_eq!(labels["org.opencontainers.image.licenses"], "Apache-2.0");
    assert_eq!(labels["io.kvfleet.image.flavour"], "cpu");
    assert!(labels["org.opencontainers.image.source"]
        .as_str()
        .is_some_and(|s| s.starts_with("https://")));
    // The cpu flavour carries no CUDA library; the model and the binary are there.
    assert!(!img.rootfs.join("usr/local/cuda").exists());
    assert!(img.rootfs.join("usr/local/bin/kvfleet").is_file());
    assert!(img
        .rootfs
        .join("opt/kvfleet/.tools/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        .is_file());

    // The Containerfile's runtime stage sets the same environment, user, directory and version.
    let containerfile = std::fs::read_to_string(repo().join("Containerfile")).unwrap();
    let mut env = Vec::new();
    let mut in_env = false;
    for line in containerfile.lines() {
        let l = line.trim();
        if let Some(rest) = l.strip_prefix("ENV ") {
            in_env = true;
            env.push(rest.trim_end_matches('\\').trim().to_string());
        } else if in_env {
            env.push(l.trim_end_matches('\\').trim().to_string());
        }
        in_env = in_env && l.ends_with('\\');
    }
    let mut image_env: Vec<String> = cfg["Env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap().to_string())
        .collect();
    env.sort();
    image_env.sort();
    assert_eq!(env, image_env, "Containerfile ENV and image/build --env differ");
    assert!(containerfile.contains("USER 65532:65532"));
    assert!(containerfile.contains("WORKDIR /opt/kvfleet"));
    assert!(containerfile.contains(&format!("org.opencontainers.image.version=\"{}\"", version())));
}

// === tests: the chart and the controller run what `make image` tags (no root needed) ===

#[test]
fn chart_and_controller_default_to_the_image_make_image_tags() {
    let expected = format!("kvfleet:{}", version());
    let out = Command::new(helm())
        .args(["template", "kvfleet"])
        .arg(repo().join("charts/kvfleet"))
        .output()
        .expect("cannot run helm");
    assert!(out.status.success(), "{}", text(&out));
    let rendered = String::from_utf8_lossy(&out.stdout);
    let images: Vec<&str> = rendered
        .lines()
        .filter_map(|l| l.trim().strip_prefix("image: "))
        .collect();
    assert_eq!(images.len(), 2, "controller and webhook: {images:?}");
    for i in images {
        assert_eq!(i.trim_matches('"'), expected);
    }
    assert!(
        rendered.contains(&format!("value: \"{expected}\"")),
        "KVFLEET_WORKER_IMAGE is not {expected}"
    );
    assert_eq!(
        kvfleet::controller::desired::Settings::default().worker_image,
        expected,
        "the controller's built-in worker image differs from the chart's"
    );
    let chart = std::fs::read_to_string(repo().join("charts/kvfleet/Chart.yaml")).unwrap();
    assert!(
        chart.contains(&format!("appVersion: \"{}\"", version())),
        "Chart.yaml appVersion is not Cargo.toml's version {}",
        version()
    );
}

#[test]
fn helm_rejects_mistyped_image_values_naming_the_key() {
    for (set, expected) in [
        ("image.repository=kvfleet:0.1.0", "/image/repository"),
        ("image.tag=0.1.0:cpu", "/image/tag"),
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("image.registry=ghcr.io", "registry"),
        ("imagePullSecrets[0].nam=regcred", "/imagePullSecrets/0"),
    ] {
        let out = Command::new(helm())
            .args(["template", "kvfleet"])
            .arg(repo().join("charts/kvfleet"))
            .args(["--set", set])
            .output()
            .expect("cannot run helm");
        assert!(!out.status.success(), "helm accepted --set {set}");
        let err = text(&out);
        assert!(
            err.contains("schema") && err.contains(expected),
            "--set {set}: the error does not name {expected}: {err}"
        );
    }
    for set in [
        "image.repository=registry.example.com:5000/team/kvfleet",
        "imagePullSecrets[0].name=regcred",
        "image.tag=0.1.0-cpu",
    ] {
        let out = Command::new(helm())
            .args(["template", "kvfleet"])
            .arg(repo().join("charts/kvfleet"))
            .args(["--set", set])
            .output()
            .expect("cannot run helm");
        assert!(out.status.success(), "--set {set}: {}", text(&out));
    }
}

// === the gpu flavour: only before a release (1 GB of wheels, a 767 MiB archive) ===

#[test]
#[ignore = "builds the gpu flavour: downloads about 1 GB of CUDA wheels and writes a 767 MiB archive (3 minutes cold); needs root, no GPU"]
fn gpu_image_holds_nvrtc_headers_and_cublas_where_the_worker_looks_and_needs_only_libcuda() {
    let img = gpu_image();
    let archive_mib = std::fs::metadata(&img.archive).unwrap().len() as f64 / 1048576.0;
    let unpacked_mib = img.layers.iter().map(|l| l.1).sum::<u64>() as f64 / 1048576.0;
    eprintln!(
        "image kvfleet:{}: archive {archive_mib:.1} MiB, unpacked {unpacked_mib:.1} MiB, built in {:.0} s",
        version(),
        img.build_seconds
    );
    let labels = &img.config["config"]["Labels"];
    assert_eq!(
        labels["org.opencontainers.image.licenses"],
        "Apache-2.0 AND LicenseRef-NVIDIA-CUDA-EULA"
    );
    for header in ["cuda_fp8.h", "cuda_bf16.h", "cuda_fp16.h", "nvrtc.h"] {
        assert!(
            img.rootfs.join("usr/local/cuda/include").join(header).is_file(),
            "{header}"
        );
    }
    // The dynamic loader of the image resolves what cudarc opens by name.
    let out = run_ok(&mut in_this_image(img, &["/sbin/ldconfig", "-p"]));
    let cache = String::from_utf8_lossy(&out.stdout);
    for lib in [
        "libnvrtc.so ",
        "libnvrtc-builtins.so.12.9",
        "libcublas.so ",
        "libcublasLt.so ",
    ] {
        assert!(cache.contains(lib), "ldconfig -p lacks {lib}:\n{cache}");
    }
    // Without a GPU the worker serves on the CPU and names the one library the NVIDIA container
    // toolkit must mount: libcuda. NVRTC and cuBLAS are not what is missing.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log = img.archive.with_file_name("worker.log");
    let child = in_this_image(
        img,
        &["kvfleet", "worker", "--listen", &format!("127.0.0.1:{port}")],
    )
    .stdout(Stdio::null())
    .stderr(std::fs::File::create(&log).unwrap())
    .spawn()
    .unwrap();
    let mut worker = Running(child);
    let deadline = Instant::now() + Duration::from_secs(180);
    while http(port, "GET", "/readyz", "").map(|r| r.0) != Some(200) {
        assert!(
            Instant::now() < deadline && worker.0.try_wait().ok().flatten().is_none(),
            "the worker in the gpu image did not become ready:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let _ = worker.0.kill();
    let _ = worker.0.wait();
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(logged.contains("libcuda.so.1"), "{logged}");
    assert!(!logged.to_lowercase().contains("nvrtc"), "{logged}");
}
