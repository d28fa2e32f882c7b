//! deploy/'s DeviceClass selectors, and the example claims' own selectors, evaluated with a real
//! CEL interpreter (the `cel` crate) against the devices tesserad publishes on a simulated node:
//! an H100 with MIG off (whole GPU, shareable), an H100 with MIG on holding an operator's
//! 3g.40gb (existing MIG device, dynamic placements on the free half), an A100 40GB with MIG on
//! (dynamic placements). Each class selects exactly its kind, each claim exactly what it asks.
//!
//! The `device` variable is built from the ResourceSlices themselves (JSON), as Kubernetes' DRA
//! CEL environment presents it: `device.driver`, `device.attributes[<domain>].<name>` (string,
//! int, bool, or a semver for version attributes), `device.capacity[<domain>].<name>` (a
//! quantity). Kubernetes' library functions the selectors may use are provided by this test:
//! `quantity()`, `semver()` and their `compareTo` / `isGreaterThan` / `isLessThan` / `asInteger`
//! methods, `major` / `minor` / `patch`; string functions (`lowerAscii`, …) come from the crate's
//! strings extension. Quantities here are whole numbers (what tesserad publishes); a fractional
//! one is an error, not a rounding.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use cel::extractors::This;
use cel::objects::{Opaque, Value};
use cel::{Context, Env, ExecutionError};
use serde_json::Value as Json;
use tessera_sim_testkit::SimNode;

mod common;

/// A Kubernetes quantity (whole units).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Quantity(u64);

impl Opaque for Quantity {
    fn runtime_type_name(&self) -> &str {
        "kubernetes.Quantity"
    }
}

/// A semantic version (the `version` attributes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Semver(u64, u64, u64);

impl Opaque for Semver {
    fn runtime_type_name(&self) -> &str {
        "kubernetes.Semver"
    }
}

impl fmt::Display for Semver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

fn err(message: String) -> ExecutionError {
    ExecutionError::function_error("kubernetes", message)
}

fn quantity_of(text: &str) -> Result<Quantity, ExecutionError> {
    tessera_daemon::dra::devices::parse_quantity(text)
        .map(Quantity)
        .ok_or_else(|| err(format!("{text:?} is not a whole-number quantity")))
}

fn semver_of(text: &str) -> Result<Semver, ExecutionError> {
    let parts: Vec<u64> =
        text.split('.').map(str::parse).collect::<Result<_, _>>().map_err(|_| err(format!("semver {text:?}")))?;
    match parts.as_slice() {
        [a, b, c] => Ok(Semver(*a, *b, *c)),
        _ => Err(err(format!("semver {text:?} needs major.minor.patch"))),
    }
}

/// Both operands as quantities or both as semvers, ordered.
fn order(this: &Arc<dyn Opaque>, other: &Arc<dyn Opaque>) -> Result<std::cmp::Ordering, ExecutionError> {
    if let (Some(a), Some(b)) = (this.downcast_ref::<Quantity>(), other.downcast_ref::<Quantity>()) {
        return Ok(a.cmp(b));
    }
    if let (Some(a), Some(b)) = (this.downcast_ref::<Semver>(), other.downcast_ref::<Semver>()) {
        return Ok(a.cmp(b));
    }
    Err(err(format!("cannot compare a {} with a {}", this.runtime_type_name(), other.runtime_type_name())))
}

fn semver_part(this: &Arc<dyn Opaque>, part: usize) -> Result<i64, ExecutionError> {
    let v =
        this.downcast_ref::<Semver>().ok_or_else(|| err(format!("a {} is not a semver", this.runtime_type_name())))?;
    Ok([v.0, v.1, v.2][part] as i64)
}

/// The CEL environment of a device selector.
fn environment() -> Arc<Env> {
    let mut env = Env::stdlib();
    env.add_extension(cel::extensions::strings).expect("strings extension");
    Arc::new(env)
}

fn context(env: &Arc<Env>, device: Value) -> Context<'static, 'static> {
    let mut ctx = Context::with_env(Arc::clone(env));
    ctx.add_function("quantity", |s: Arc<String>| -> Result<Arc<dyn Opaque>, ExecutionError> {
        Ok(Arc::new(quantity_of(&s)?))
    })
    .unwrap();
    ctx.add_function("semver", |s: Arc<String>| -> Result<Arc<dyn Opaque>, ExecutionError> {
        Ok(Arc::new(semver_of(&s)?))
    })
    .unwrap();
    ctx.add_function(
        "compareTo",
        |This(a): This<Arc<dyn Opaque>>, b: Arc<dyn Opaque>| -> Result<i64, ExecutionError> {
            Ok(order(&a, &b)? as i64)
        },
    )
    .unwrap();
    ctx.add_function("isGreaterThan", |This(a): This<Arc<dyn Opaque>>, b: Arc<dyn Opaque>| {
        order(&a, &b).map(|o| o.is_gt())
    })
    .unwrap();
    ctx.add_function("isLessThan", |This(a): This<Arc<dyn Opaque>>, b: Arc<dyn Opaque>| {
        order(&a, &b).map(|o| o.is_lt())
    })
    .unwrap();
    ctx.add_function("asInteger", |This(a): This<Arc<dyn Opaque>>| -> Result<i64, ExecutionError> {
        let q = a
            .downcast_ref::<Quantity>()
            .ok_or_else(|| err(format!("a {} is not a quantity", a.runtime_type_name())))?;
        i64::try_from(q.0).map_err(|_| err(format!("{} overflows an int", q.0)))
    })
    .unwrap();
    ctx.add_function("major", |This(a): This<Arc<dyn Opaque>>| semver_part(&a, 0)).unwrap();
    ctx.add_function("minor", |This(a): This<Arc<dyn Opaque>>| semver_part(&a, 1)).unwrap();
    ctx.add_function("patch", |This(a): This<Arc<dyn Opaque>>| semver_part(&a, 2)).unwrap();
    ctx.add_variable_from_value("device", device);
    ctx
}

/// One published device (a slice's `spec.devices[]` entry) as Kubernetes' `device` variable.
fn device_value(driver: &str, d: &Json) -> Value {
    let mut attributes: HashMap<String, HashMap<String, Value>> = HashMap::new();
    for (name, a) in d["attributes"].as_object().into_iter().flatten() {
        let v = if let Some(s) = a["string"].as_str() {
            Value::from(s)
        } else if let Some(n) = a["int"].as_i64() {
            Value::Int(n)
        } else if let Some(b) = a["bool"].as_bool() {
            Value::Bool(b)
        } else if let Some(v) = a["version"].as_str() {
            Value::Opaque(Arc::new(semver_of(v).expect("a published version is a semver")))
        } else {
            panic!("attribute {name} of {} has no value: {a}", d["name"]);
        };
        // Unqualified names belong to the driver's domain.
        let (domain, short) = name.split_once('/').unwrap_or((driver, name));
        attributes.entry(domain.to_owned()).or_default().insert(short.to_owned(), v);
    }
    let capacity: HashMap<String, Value> = d["capacity"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, c)| {
            let q = quantity_of(c["value"].as_str().expect("a capacity value")).expect("a published quantity");
            (name.clone(), Value::Opaque(Arc::new(q)))
        })
        .collect();
    let device: HashMap<String, Value> = HashMap::from([
        ("driver".to_string(), Value::from(driver)),
        ("attributes".to_string(), Value::from(attributes)),
        ("capacity".to_string(), Value::from(HashMap::from([(driver.to_string(), Value::from(capacity))]))),
        ("allowMultipleAllocations".to_string(), Value::Bool(d["allowMultipleAllocations"] == true)),
    ]);
    Value::from(device)
}

/// The names of the devices every one of `expressions` selects (an evaluation error counts as a
/// failure of the test: Kubernetes would refuse the claim).
fn select(env: &Arc<Env>, devices: &[(String, Value)], expressions: &[String]) -> BTreeSet<String> {
    let programs: Vec<_> = expressions
        .iter()
        .map(|e| env.compile(e).unwrap_or_else(|err| panic!("CEL {e:?} does not compile: {err:?}")))
        .collect();
    devices
        .iter()
        .filter(|(name, device)| {
            programs.iter().zip(expressions).all(|(p, e)| {
                let ctx = context(env, device.clone());
                match p.execute(&ctx) {
                    Ok(Value::Bool(b)) => b,
                    other => panic!("{e:?} on {name}: {other:?}"),
                }
            })
        })
        .map(|(name, _)| name.clone())
        .collect()
}

/// A Python with PyYAML: kubernetes-validate's virtual environment (scripts/deps.sh), or SKIP.
fn python() -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/k8s-validate/bin/python");
    let ok = |p: &Path| Command::new(p).args(["-c", "import yaml"]).output().is_ok_and(|o| o.status.success());
    if ok(&venv) {
        return Some(venv);
    }
    if ok(Path::new("python3")) {
        return Some(PathBuf::from("python3"));
    }
    common::skip("no Python with PyYAML (scripts/deps.sh puts one in target/k8s-validate)");
    None
}

/// The YAML documents of a deploy/ file as JSON.
fn documents(python: &Path, file: &str) -> Vec<Json> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes").join(file);
    let yaml = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    common::yaml_documents(python, &yaml)
}

fn selectors(v: &Json) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .map(|s| s["cel"]["expression"].as_str().expect("a CEL selector").to_owned())
        .collect()
}

/// Two H100s and an A100.
fn node_description() -> String {
    tessera_sim_testkit::describe(1, &[("H100-SXM5-80GB", 2, ""), ("A100-SXM4-40GB", 1, "")])
}

#[test]
fn device_classes_and_example_claims_select_exactly_their_devices() {
    let Some(python) = python() else { return };
    let node = SimNode::with_description(&node_description());
    if !tessera_sim_testkit::in_child() {
        let sim = tessera_sim_model::Node::open(node.description.as_deref(), Some(&node.state)).expect("sim node");
        for gpu in [1, 2] {
            sim.set_mig_mode(gpu, true).expect("MIG on");
            sim.reset(gpu).expect("reset");
        }
        // An operator's 3g.40gb (NVML profile 2) on GPU 1's memory slices 0..4.
        let gi = sim.create_gpu_instance(1, 2, Some(0)).expect("3g.40gb");
        sim.create_compute_instance(1, gi.id, 2, None).expect("its compute instance");
    }
    node.run_isolated("device_classes_and_example_claims_select_exactly_their_devices", || {
        evaluate(&node, &python);
    });
}

fn evaluate(node: &SimNode, python: &Path) {
    use tessera_daemon::dra::devices::from_inventory;
    use tessera_daemon::dra::dynamic_mig::with_placements;
    use tessera_daemon::dra::slices::{SliceLayout, build_pool};
    let session = tessera_daemon::discovery::Session::open(Some(node.nvml_path().as_path()), false).expect("session");
    let inv = session.inventory().expect("inventory");
    let healthy = tessera_daemon::device_health::NodeHealth::default();
    let published =
        with_placements(from_inventory(&inv, |_| true, &healthy), &inv, |_| true, &BTreeSet::new(), &healthy);
    let mut devices = Vec::new();
    for slice in build_pool("node-a", &published, 0, SliceLayout::Separate) {
        let slice = serde_json::to_value(&slice).unwrap();
        for d in slice["spec"]["devices"].as_array().into_iter().flatten() {
            devices.push((d["name"].as_str().unwrap().to_owned(), device_value("gpu.tessera.io", d)));
        }
    }
    let names = |f: &dyn Fn(&str) -> bool| -> BTreeSet<String> {
        devices.iter().map(|(n, _)| n.clone()).filter(|n| f(n)).collect()
    };
    let existing_mig = names(&|n| {
        n.starts_with("gpu-1-mig-") && n.split('-').all(|p| p == "gpu" || p == "mig" || p.parse::<u32>().is_ok())
    });
    assert_eq!(existing_mig.len(), 1, "the operator's 3g.40gb: {devices:?}", devices = names(&|_| true));
    let placements =
        names(&|n| (n.starts_with("gpu-1-mig-") || n.starts_with("gpu-2-mig-")) && !existing_mig.contains(n));
    assert!(placements.len() > 20, "{placements:?}");
    // Another driver's device must never be selected by ours.
    devices.push(("other-gpu".into(), {
        let d = serde_json::json!({"name": "other-gpu", "attributes": {"type": {"string": "gpu"}, "productName": {"string": "H100"}},
            "capacity": {"memory": {"value": "80Gi"}}});
        device_value("gpu.nvidia.com", &d)
    }));

    let env = environment();
    let classes: BTreeMap<String, Vec<String>> = documents(python, "overlays/dra/deviceclass.yaml")
        .into_iter()
        .map(|c| (c["metadata"]["name"].as_str().unwrap().to_owned(), selectors(&c["spec"]["selectors"])))
        .collect();
    let expected: BTreeMap<&str, BTreeSet<String>> = BTreeMap::from([
        ("gpu.tessera.io", BTreeSet::from(["gpu-0".to_string()])),
        ("gpu-share.tessera.io", BTreeSet::from(["gpu-0-shared".to_string()])),
        ("mig.tessera.io", existing_mig.clone()),
        ("mig-dynamic.tessera.io", placements.clone()),
    ]);
    assert_eq!(classes.keys().map(String::as_str).collect::<Vec<_>>(), expected.keys().copied().collect::<Vec<_>>());
    for (class, exprs) in &classes {
        assert_eq!(select(&env, &devices, exprs), expected[class.as_str()], "class {class}");
    }

    // The example claims: their class's selectors and their own, together.
    let mut claims = BTreeMap::new();
    for file in ["whole-gpu.yaml", "share-h100.yaml", "shared-by-two.yaml", "mig.yaml", "mig-dynamic.yaml"] {
        for d in documents(python, &format!("examples/dra/{file}")) {
            let spec = match d["kind"].as_str() {
                Some("ResourceClaimTemplate") => &d["spec"]["spec"],
                Some("ResourceClaim") => &d["spec"],
                _ => continue,
            };
            let r = &spec["devices"]["requests"][0]["exactly"];
            let mut exprs = classes[r["deviceClassName"].as_str().unwrap()].clone();
            exprs.extend(selectors(&r["selectors"]));
            claims.insert(d["metadata"]["name"].as_str().unwrap().to_owned(), select(&env, &devices, &exprs));
        }
    }
    let one = |n: &str| BTreeSet::from([n.to_string()]);
    assert_eq!(claims["whole-gpu"], one("gpu-0"));
    assert_eq!(claims["share-8gi-30pct-h100"], one("gpu-0-shared"));
    assert_eq!(claims["shared-16gi-50pct"], one("gpu-0-shared"));
    assert_eq!(claims["mig-3g-40gb"], existing_mig);
    // GPU 1's free half only: its slices 0..4 are the operator's; the A100 has no 3g.40gb.
    assert_eq!(claims["mig-3g-40gb-dynamic"], one("gpu-1-mig-3g40gb-4"));

    // Kubernetes' quantity and semver helpers on what tesserad publishes.
    let pick = |e: &str| select(&env, &devices, &[classes["mig-dynamic.tessera.io"][0].clone(), e.to_owned()]);
    let big = pick(r#"device.capacity["gpu.tessera.io"].memory.compareTo(quantity("20Gi")) >= 0"#);
    assert!(big.contains("gpu-1-mig-3g40gb-4") && big.contains("gpu-2-mig-7g40gb-0"), "{big:?}");
    assert!(!big.iter().any(|n| n.contains("1g10gb") || n.contains("1g5gb")), "{big:?}");
    let hopper = pick(r#"device.attributes["gpu.tessera.io"].cudaComputeCapability.isGreaterThan(semver("8.9.0"))"#);
    assert!(!hopper.is_empty() && hopper.iter().all(|n| n.starts_with("gpu-1-")), "{hopper:?}");
    let sms = pick(r#"device.capacity["gpu.tessera.io"].multiprocessors.asInteger() > 60"#);
    // GPU 1's 4g and 7g placements overlap the operator's instance; its 3g has 60 SMs.
    assert_eq!(sms, BTreeSet::from(["gpu-2-mig-7g40gb-0".to_string()]));
    // The check can fail: an expression on a missing attribute is an error, not a silent false.
    let e = env.compile(r#"device.attributes["gpu.tessera.io"].noSuchAttribute == "x""#).unwrap();
    assert!(e.execute(&context(&env, devices[0].1.clone())).is_err());
}
