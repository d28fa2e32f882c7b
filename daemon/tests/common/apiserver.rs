//! A small Kubernetes API server for tests, speaking the real REST protocol (JSON over HTTP/1.1)
//! for the few resources the DRA driver uses, so kube-rs talks to it unchanged:
//!
//! - `GET /apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}`;
//! - `PATCH …/resourceclaims/{name}/status` by server-side apply (`application/apply-patch+yaml`,
//!   what kube-rs sends for `Patch::Apply`) of `status.devices`: entries keyed by driver, pool,
//!   device and shareID, owned per `fieldManager` (an apply replaces the manager's entries and
//!   removes those it no longer names; another manager's entry is a 409 unless `force`), each
//!   entry checked against the claim's allocation results (422), `metadata.uid` a precondition
//!   (409);
//! - `resourceslices`: list (with `fieldSelector` on `spec.nodeName` / `spec.driver`), get,
//!   create (409 AlreadyExists), replace (409 Conflict on a stale `metadata.resourceVersion`),
//!   delete; and watch (`?watch=true&resourceVersion=N`: the events after N, then live ones;
//!   410 Gone for a version older than the history kept).
//!
//! - `nodes`: get and JSON merge patch (`put_node` adds one);
//! - events.k8s.io/v1 `events`: create (409 AlreadyExists) and JSON merge patch (404 when gone);
//! - `GET /version`: 1.34.0 unless [`ApiServer::set_version`] says otherwise (clients pick the
//!   slice layout and what becomes of unhealthy devices by it);
//! - `GET /apis/resource.k8s.io/v1` (discovery: its resources), 404 for a version before 1.34 or
//!   after [`ApiServer::without_resource_v1`] (a server whose `--runtime-config` turned it off).
//!
//! Objects carry a global, increasing resourceVersion. Failures can be injected (`fail_next`),
//! and the server stopped and started again on the same port (an API server restart).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::broadcast;
use tokio::task::JoinHandle;

const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";
const CLAIMS_PREFIX: &str = "/apis/resource.k8s.io/v1/namespaces/";
const NODES: &str = "/api/v1/nodes/";
const EVENTS_PREFIX: &str = "/apis/events.k8s.io/v1/namespaces/";
/// Events kept for watches that resume; older versions get 410 Gone.
const HISTORY: usize = 64;

#[derive(Default)]
struct Store {
    version: u64,
    slices: BTreeMap<String, Value>,
    claims: BTreeMap<(String, String), Value>,
    /// (resourceVersion, type, object) of slice changes.
    history: Vec<(u64, &'static str, Value)>,
    /// Requests seen: "METHOD path".
    requests: Vec<String>,
    /// Failures to inject: (method, status code) answered to the next matching request.
    failures: Vec<(Method, u16)>,
    /// Per claim, per field manager: the keys of the `status.devices` entries it owns.
    status_owners: BTreeMap<(String, String), BTreeMap<String, Vec<Value>>>,
    /// Drop `devices[].taints` from written slices, as a server with DRADeviceTaints off does.
    drop_taints: bool,
    /// Nodes by name (get, merge patch).
    nodes: BTreeMap<String, Value>,
    /// events.k8s.io/v1 Events by (namespace, name) (create, merge patch).
    events: BTreeMap<(String, String), Value>,
    /// What `/version` says: (major, minor, patch); `None`: 1.34.0.
    kube_version: Option<(u32, u32, u32)>,
    /// resource.k8s.io/v1 is not served (discovery answers 404).
    no_resource_v1: bool,
}

/// The test API server.
pub struct ApiServer {
    pub addr: SocketAddr,
    store: Arc<Mutex<Store>>,
    events: broadcast::Sender<(u64, &'static str, Value)>,
    task: Option<JoinHandle<()>>,
}

fn status(code: u16, reason: &str, message: &str) -> Response<Full<Bytes>> {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code});
    respond(code, &body)
}

/// 200 with `obj`, or 404 saying `missing` when there is none.
fn found(obj: Option<&Value>, missing: &str) -> Response<Full<Bytes>> {
    obj.map_or_else(|| status(404, "NotFound", missing), |o| respond(200, o))
}

fn respond(code: u16, body: &Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(StatusCode::from_u16(code).expect("status code"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("response")
}

fn query(uri: &hyper::Uri) -> BTreeMap<String, String> {
    let decode = |s: &str| {
        let s = s.replace('+', " ");
        let mut out = Vec::new();
        let b = s.as_bytes();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%'
                && i + 3 <= b.len()
                && let Some(v) = std::str::from_utf8(&b[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                out.push(v);
                i += 3;
                continue;
            }
            out.push(b[i]);
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    uri.query()
        .unwrap_or_default()
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// Whether `slice` matches a `fieldSelector` such as `spec.nodeName=n,spec.driver=d`.
fn selected(slice: &Value, selector: Option<&String>) -> bool {
    let Some(sel) = selector else { return true };
    sel.split(',').filter(|t| !t.is_empty()).all(|term| {
        let (key, want) = term.split_once('=').unwrap_or((term, ""));
        let want = want.trim_start_matches('=');
        let got = match key {
            "spec.nodeName" => slice["spec"]["nodeName"].as_str(),
            "spec.driver" => slice["spec"]["driver"].as_str(),
            "metadata.name" => slice["metadata"]["name"].as_str(),
            _ => None,
        };
        got == Some(want)
    })
}

impl Store {
    /// A JSON merge patch (`patch`, parsed from the body) of the object `key` in the map `objects`
    /// picks: the patched object with a new resourceVersion, 400 when the body is not JSON, 404
    /// (`missing`) when there is no such object.
    fn merge_patched<K: Ord>(
        &mut self,
        objects: fn(&mut Store) -> &mut BTreeMap<K, Value>,
        key: K,
        patch: serde_json::Result<Value>,
        missing: &str,
    ) -> Response<Full<Bytes>> {
        let Ok(patch) = patch else { return status(400, "BadRequest", "not JSON") };
        let Some(mut obj) = objects(self).get(&key).cloned() else { return status(404, "NotFound", missing) };
        merge_patch(&mut obj, &patch);
        self.bump(&mut obj);
        objects(self).insert(key, obj.clone());
        respond(200, &obj)
    }

    fn bump(&mut self, obj: &mut Value) -> u64 {
        self.version += 1;
        obj["metadata"]["resourceVersion"] = json!(self.version.to_string());
        self.version
    }

    fn record(&mut self, events: &broadcast::Sender<(u64, &'static str, Value)>, kind: &'static str, obj: &Value) {
        let v = self.version;
        self.history.push((v, kind, obj.clone()));
        if self.history.len() > HISTORY {
            self.history.remove(0);
        }
        let _ = events.send((v, kind, obj.clone()));
    }
}

impl ApiServer {
    /// Starts on a free port of 127.0.0.1.
    pub async fn start() -> ApiServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (events, _) = broadcast::channel(256);
        let mut s = ApiServer { addr, store: Arc::default(), events, task: None };
        s.serve(listener);
        s
    }

    fn serve(&mut self, listener: TcpListener) {
        let store = Arc::clone(&self.store);
        let events = self.events.clone();
        self.task = Some(tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                let store = Arc::clone(&store);
                let events = events.clone();
                let service = hyper::service::service_fn(move |req| {
                    let store = Arc::clone(&store);
                    let events = events.clone();
                    async move { Ok::<_, std::convert::Infallible>(handle(req, store, events).await) }
                });
                conns.spawn(async move {
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
                });
            }
            // Dropping `conns` (the task aborted) closes every connection: a restart.
        }));
    }

    /// Stops answering and closes every connection (a crashed or restarting API server).
    pub async fn stop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }

    /// Starts again on the same port, with the same objects.
    pub async fn restart(&mut self) {
        self.stop().await;
        let listener = TcpListener::bind(self.addr).await.expect("rebind the same port");
        self.serve(listener);
    }

    /// `tesserad`'s configuration in Kubernetes `mode` against this server, on the fake GPU host
    /// and with the kubelet's directories under `dir`: `extra` (keys, tables) before the
    /// `[kubernetes]` table, `kubernetes` (its keys) at its end.
    pub fn tesserad_config(
        &self,
        node: &tessera_sim_testkit::SimNode,
        dir: &Path,
        mode: &str,
        extra: &str,
        kubernetes: &str,
    ) -> PathBuf {
        let kubeconfig = self.kubeconfig(dir);
        let (plugins, registry) = (dir.join("kubelet/plugins"), dir.join("kubelet/plugins_registry"));
        std::fs::create_dir_all(&registry).expect("registry dir");
        let injection = super::fake_gpu_host(dir);
        let body = format!(
            "pod_resources_socket = \"\"\n{injection}{extra}\n[kubernetes]\nmode = {mode:?}\nnode_name = \"node-a\"\n\
             kubeconfig = {kubeconfig:?}\nplugins_dir = {plugins:?}\nplugins_registry_dir = {registry:?}\n{kubernetes}\n"
        );
        super::write_config(node, dir, &body)
    }

    /// A kubeconfig file for this server (plain HTTP, no credentials).
    pub fn kubeconfig(&self, dir: &Path) -> PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: http://{}\n\
             users:\n- name: test\n  user: {{}}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n\
             current-context: test\n",
            self.addr
        );
        std::fs::write(&path, text).expect("kubeconfig");
        path
    }

    /// Adds or replaces a ResourceClaim (the scheduler's allocation in its status).
    pub fn put_claim(&self, claim: Value) {
        let mut s = self.store.lock().unwrap();
        let mut claim = claim;
        s.bump(&mut claim);
        let key = (
            claim["metadata"]["namespace"].as_str().expect("namespace").to_owned(),
            claim["metadata"]["name"].as_str().expect("name").to_owned(),
        );
        s.claims.insert(key, claim);
    }

    /// A ResourceClaim as stored now.
    pub fn claim(&self, namespace: &str, name: &str) -> Option<Value> {
        self.store.lock().unwrap().claims.get(&(namespace.to_owned(), name.to_owned())).cloned()
    }

    /// Every ResourceSlice, by name.
    pub fn slices(&self) -> BTreeMap<String, Value> {
        self.store.lock().unwrap().slices.clone()
    }

    /// The devices of `pool` across its slices, by name (1.34 puts each shared device in a
    /// slice of its own); `None` while the pool has no slice, or is not complete yet (as the
    /// scheduler reads it: as many slices of its newest generation as each says it has), since
    /// a driver publishes a pool's slices one at a time.
    pub fn pool_devices(&self, pool: &str) -> Option<Vec<Value>> {
        let store = self.store.lock().unwrap();
        let slices: Vec<&Value> = store.slices.values().filter(|s| s["spec"]["pool"]["name"] == pool).collect();
        let generation = slices.iter().filter_map(|s| s["spec"]["pool"]["generation"].as_i64()).max();
        let newest: Vec<&&Value> =
            slices.iter().filter(|s| s["spec"]["pool"]["generation"].as_i64() == generation).collect();
        let complete =
            newest.iter().all(|s| s["spec"]["pool"]["resourceSliceCount"].as_u64() == Some(newest.len() as u64));
        if !complete {
            return None;
        }
        let mut devices: Vec<Value> =
            slices.iter().flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default()).collect();
        devices.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
        (!slices.is_empty()).then_some(devices)
    }

    /// Creates a slice directly (another writer, or one left by an earlier node layout).
    pub fn put_slice(&self, slice: Value) {
        let mut s = self.store.lock().unwrap();
        let mut slice = slice;
        s.bump(&mut slice);
        let name = slice["metadata"]["name"].as_str().expect("name").to_owned();
        s.record(&self.events, "ADDED", &slice);
        s.slices.insert(name, slice);
    }

    /// Deletes a slice directly (another writer, an administrator); whether it was there.
    pub fn delete_slice(&self, name: &str) -> bool {
        let mut s = self.store.lock().unwrap();
        let Some(mut slice) = s.slices.remove(name) else { return false };
        s.bump(&mut slice);
        s.record(&self.events, "DELETED", &slice);
        true
    }

    /// resource.k8s.io/v1 is no longer served (discovery answers 404), as with kube-apiserver's
    /// `--runtime-config resource.k8s.io/v1=false`.
    pub fn without_resource_v1(&self) {
        self.store.lock().unwrap().no_resource_v1 = true;
    }

    /// The Kubernetes version `/version` reports from now on.
    pub fn set_version(&self, major: u32, minor: u32, patch: u32) {
        self.store.lock().unwrap().kube_version = Some((major, minor, patch));
    }

    /// The next request with `method` gets `code` (a Status) instead of its answer.
    pub fn fail_next(&self, method: Method, code: u16) {
        self.store.lock().unwrap().failures.push((method, code));
    }

    /// Written slices lose their device taints (the DRADeviceTaints gate off).
    pub fn drop_taints(&self) {
        self.store.lock().unwrap().drop_taints = true;
    }

    /// Adds or replaces a Node.
    pub fn put_node(&self, node: Value) {
        let mut s = self.store.lock().unwrap();
        let mut node = node;
        s.bump(&mut node);
        let name = node["metadata"]["name"].as_str().expect("name").to_owned();
        s.nodes.insert(name, node);
    }

    /// A Node as stored.
    pub fn node(&self, name: &str) -> Option<Value> {
        self.store.lock().unwrap().nodes.get(name).cloned()
    }

    /// Every events.k8s.io Event, by (namespace, name).
    pub fn events(&self) -> BTreeMap<(String, String), Value> {
        self.store.lock().unwrap().events.clone()
    }

    /// Every request so far, as "METHOD path".
    pub fn requests(&self) -> Vec<String> {
        self.store.lock().unwrap().requests.clone()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

async fn handle(
    req: Request<hyper::body::Incoming>,
    store: Arc<Mutex<Store>>,
    events: broadcast::Sender<(u64, &'static str, Value)>,
) -> Response<Full<Bytes>> {
    let method = req.method().clone();
    let uri = req.uri().clone();
    let path = uri.path().to_owned();
    let q = query(&uri);
    let content_type =
        req.headers().get(hyper::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return status(400, "BadRequest", "unreadable body"),
    };
    if q.get("watch").is_some_and(|w| w == "true" || w == "1") && path == SLICES {
        return watch(&store, &events, &q).await;
    }
    let mut s = store.lock().unwrap();
    s.requests.push(format!("{method} {path}"));
    if let Some(i) = s.failures.iter().position(|(m, _)| *m == method) {
        let (_, code) = s.failures.remove(i);
        let reason = match code {
            409 => "Conflict",
            410 => "Expired",
            429 => "TooManyRequests",
            _ => "InternalError",
        };
        return status(code, reason, "injected failure");
    }
    if path == "/version" && method == Method::GET {
        let (major, minor, patch) = s.kube_version.unwrap_or((1, 34, 0));
        return respond(
            200,
            &json!({"major": major.to_string(), "minor": minor.to_string(),
                "gitVersion": format!("v{major}.{minor}.{patch}"), "gitCommit": "", "gitTreeState": "clean",
                "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.25", "compiler": "gc", "platform": "linux/amd64"}),
        );
    }
    if path == "/apis/resource.k8s.io/v1" && method == Method::GET {
        if s.no_resource_v1 || s.kube_version.is_some_and(|(_, minor, _)| minor < 34) {
            return status(404, "NotFound", "the server could not find the requested resource");
        }
        let resource = |name: &str, kind: &str, namespaced: bool| {
            json!({"name": name, "singularName": "", "namespaced": namespaced, "kind": kind,
                "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]})
        };
        return respond(
            200,
            &json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "resource.k8s.io/v1",
                "resources": [resource("resourceslices", "ResourceSlice", false),
                    resource("resourceclaims", "ResourceClaim", true),
                    resource("deviceclasses", "DeviceClass", false)]}),
        );
    }
    let parsed = || serde_json::from_slice::<Value>(&body);
    let drop_taints = s.drop_taints;
    let parsed = || {
        parsed().map(|mut v| {
            if drop_taints && let Some(ds) = v["spec"]["devices"].as_array_mut() {
                for d in ds {
                    if let Some(d) = d.as_object_mut() {
                        d.remove("taints");
                    }
                }
            }
            v
        })
    };
    if let Some(name) = path.strip_prefix(NODES) {
        let name = name.to_owned();
        return match method {
            Method::GET => found(s.nodes.get(&name), &format!("nodes \"{name}\" not found")),
            Method::PATCH => {
                let missing = format!("nodes \"{name}\" not found");
                s.merge_patched(|s| &mut s.nodes, name, parsed(), &missing)
            }
            _ => status(405, "MethodNotAllowed", "method not allowed"),
        };
    }
    if let Some(rest) = path.strip_prefix(EVENTS_PREFIX) {
        let parts: Vec<&str> = rest.split('/').collect();
        return match (parts.as_slice(), &method) {
            ([ns, "events"], &Method::POST) => {
                let Ok(mut obj) = parsed() else { return status(400, "BadRequest", "not JSON") };
                let Some(name) = obj["metadata"]["name"].as_str().map(str::to_owned) else {
                    return status(422, "Invalid", "metadata.name: Required value");
                };
                let key = ((*ns).to_owned(), name.clone());
                if s.events.contains_key(&key) {
                    return status(409, "AlreadyExists", &format!("events \"{name}\" already exists"));
                }
                s.bump(&mut obj);
                s.events.insert(key, obj.clone());
                respond(201, &obj)
            }
            ([ns, "events", name], &Method::PATCH) => {
                let key = ((*ns).to_owned(), (*name).to_owned());
                let missing = format!("events.events.k8s.io \"{name}\" not found");
                s.merge_patched(|s| &mut s.events, key, parsed(), &missing)
            }
            _ => status(405, "MethodNotAllowed", "method not allowed"),
        };
    }
    if let Some(rest) = path.strip_prefix(CLAIMS_PREFIX) {
        let parts: Vec<&str> = rest.split('/').collect();
        if let [ns, "resourceclaims", name] = parts.as_slice()
            && method == Method::GET
        {
            return found(
                s.claims.get(&((*ns).to_owned(), (*name).to_owned())),
                &format!("resourceclaims.resource.k8s.io \"{name}\" not found"),
            );
        }
        if let [ns, "resourceclaims", name, "status"] = parts.as_slice()
            && method == Method::PATCH
        {
            return apply_claim_status(&mut s, ns, name, &q, &content_type, &body);
        }
        return status(404, "NotFound", "no such resource");
    }
    if path == SLICES {
        return match method {
            Method::GET => {
                let items: Vec<Value> =
                    s.slices.values().filter(|v| selected(v, q.get("fieldSelector"))).cloned().collect();
                respond(
                    200,
                    &json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                        "metadata": {"resourceVersion": s.version.to_string()}, "items": items}),
                )
            }
            Method::POST => {
                let Ok(mut obj) = parsed() else { return status(400, "BadRequest", "not JSON") };
                let Some(name) = obj["metadata"]["name"].as_str().map(str::to_owned) else {
                    return status(422, "Invalid", "metadata.name: Required value");
                };
                if s.slices.contains_key(&name) {
                    return status(409, "AlreadyExists", &format!("resourceslices \"{name}\" already exists"));
                }
                obj["metadata"]["uid"] = json!(format!("uid-{name}-{}", s.version + 1));
                s.bump(&mut obj);
                s.record(&events, "ADDED", &obj);
                s.slices.insert(name, obj.clone());
                respond(201, &obj)
            }
            _ => status(405, "MethodNotAllowed", "method not allowed"),
        };
    }
    if let Some(name) = path.strip_prefix(&format!("{SLICES}/")) {
        let name = name.to_owned();
        return match method {
            Method::GET => found(s.slices.get(&name), &format!("resourceslices \"{name}\" not found")),
            Method::PUT => {
                let Ok(mut obj) = parsed() else { return status(400, "BadRequest", "not JSON") };
                let Some(cur) = s.slices.get(&name) else {
                    return status(404, "NotFound", &format!("resourceslices \"{name}\" not found"));
                };
                let want = obj["metadata"]["resourceVersion"].as_str().unwrap_or_default().to_owned();
                if want != cur["metadata"]["resourceVersion"].as_str().unwrap_or_default() {
                    return status(
                        409,
                        "Conflict",
                        &format!(
                            "Operation cannot be fulfilled on resourceslices \"{name}\": the object has been modified"
                        ),
                    );
                }
                obj["metadata"]["uid"] = cur["metadata"]["uid"].clone();
                s.bump(&mut obj);
                s.record(&events, "MODIFIED", &obj);
                s.slices.insert(name, obj.clone());
                respond(200, &obj)
            }
            Method::DELETE => match s.slices.remove(&name) {
                Some(mut obj) => {
                    s.bump(&mut obj);
                    s.record(&events, "DELETED", &obj);
                    respond(200, &obj)
                }
                None => status(404, "NotFound", &format!("resourceslices \"{name}\" not found")),
            },
            _ => status(405, "MethodNotAllowed", "method not allowed"),
        };
    }
    status(404, "NotFound", "the server could not find the requested resource")
}

/// The key of a `status.devices` entry (its list-map keys).
fn status_key(entry: &Value) -> Value {
    json!([entry["driver"], entry["pool"], entry["device"], entry.get("shareID").cloned().unwrap_or(Value::Null)])
}

/// Server-side apply of a ResourceClaim's `status.devices` (the only status field this server
/// lets an apply change).
fn apply_claim_status(
    s: &mut Store,
    ns: &str,
    name: &str,
    q: &BTreeMap<String, String>,
    content_type: &str,
    body: &[u8],
) -> Response<Full<Bytes>> {
    if !content_type.starts_with("application/apply-patch+yaml") {
        return status(415, "UnsupportedMediaType", &format!("this server applies only, not {content_type:?} patches"));
    }
    let Some(manager) = q.get("fieldManager").filter(|m| !m.is_empty()).cloned() else {
        return status(422, "Invalid", "fieldManager: Required value: is required for apply patch");
    };
    let force = q.get("force").is_some_and(|f| f == "true");
    let Ok(patch) = serde_json::from_slice::<Value>(body) else { return status(400, "BadRequest", "not JSON") };
    if patch["apiVersion"] != "resource.k8s.io/v1" || patch["kind"] != "ResourceClaim" {
        return status(400, "BadRequest", "apiVersion and kind must be resource.k8s.io/v1 ResourceClaim");
    }
    let key = (ns.to_owned(), name.to_owned());
    let Some(mut claim) = s.claims.get(&key).cloned() else {
        return status(404, "NotFound", &format!("resourceclaims.resource.k8s.io \"{name}\" not found"));
    };
    if let Some(uid) = patch["metadata"]["uid"].as_str()
        && Some(uid) != claim["metadata"]["uid"].as_str()
    {
        return status(409, "Conflict", &format!("Precondition failed: UID in precondition: {uid}"));
    }
    let wanted: Vec<Value> = patch["status"]["devices"].as_array().cloned().unwrap_or_default();
    let results = claim["status"]["allocation"]["devices"]["results"].as_array().cloned().unwrap_or_default();
    for (i, e) in wanted.iter().enumerate() {
        let allocated = results.iter().any(|r| {
            r["driver"] == e["driver"]
                && r["pool"] == e["pool"]
                && r["device"] == e["device"]
                && r.get("shareID") == e.get("shareID")
        });
        if !allocated {
            return status(
                422,
                "Invalid",
                &format!("status.devices[{i}]: Invalid value: {e}: must be an allocated device in the claim"),
            );
        }
        if e.get("data").is_some_and(|d| !d.is_object()) {
            return status(422, "Invalid", &format!("status.devices[{i}].data: must be an object"));
        }
    }
    let keys: Vec<Value> = wanted.iter().map(status_key).collect();
    let owners = s.status_owners.entry(key.clone()).or_default();
    if !force
        && let Some((other, _)) =
            owners.iter().find(|(m, owned)| **m != manager && owned.iter().any(|k| keys.contains(k)))
    {
        return status(409, "Conflict", &format!("Apply failed with 1 conflict: conflict with {other:?}"));
    }
    let before = owners.insert(manager.clone(), keys.clone()).unwrap_or_default();
    // Forced: the entries taken from other managers are no longer theirs.
    for (_, owned) in owners.iter_mut().filter(|(m, _)| **m != manager) {
        owned.retain(|k| !keys.contains(k));
    }
    let mut devices: Vec<Value> = claim["status"]["devices"].as_array().cloned().unwrap_or_default();
    devices.retain(|d| {
        let k = status_key(d);
        !before.contains(&k) || keys.contains(&k)
    });
    for e in wanted {
        let k = status_key(&e);
        match devices.iter_mut().find(|d| status_key(d) == k) {
            Some(d) => *d = e,
            None => devices.push(e),
        }
    }
    if devices.is_empty() {
        if let Some(st) = claim["status"].as_object_mut() {
            st.remove("devices");
        }
    } else {
        claim["status"]["devices"] = Value::Array(devices);
    }
    s.bump(&mut claim);
    s.claims.insert(key, claim.clone());
    respond(200, &claim)
}

/// An RFC 7386 JSON merge patch: objects merged key by key, `null` removes, anything else replaces.
fn merge_patch(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (_, Some(p)) => {
            *target = Value::Object(Default::default());
            merge_patch(target, &Value::Object(p.clone()));
        }
        _ => *target = patch.clone(),
    }
}

/// A watch: the history after `resourceVersion`, then live events for a short while (the body is
/// sent whole when the window ends: enough for clients that resume). 410 Gone when the version is
/// older than the history kept.
async fn watch(
    store: &Arc<Mutex<Store>>,
    events: &broadcast::Sender<(u64, &'static str, Value)>,
    q: &BTreeMap<String, String>,
) -> Response<Full<Bytes>> {
    let from: u64 = q.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut rx = events.subscribe();
    let mut lines = Vec::new();
    {
        let mut s = store.lock().unwrap();
        s.requests.push(format!("WATCH {SLICES}"));
        let oldest = s.history.first().map_or(s.version, |(v, _, _)| v.saturating_sub(1));
        if from < oldest {
            let gone = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired",
                "code": 410, "message": format!("too old resource version: {from} ({oldest})")});
            lines.push(json!({"type": "ERROR", "object": gone}).to_string());
            return respond_lines(lines);
        }
        for (v, kind, obj) in s.history.iter().filter(|(v, _, _)| *v > from) {
            let _ = v;
            lines.push(json!({"type": kind, "object": obj}).to_string());
        }
    }
    let window = tokio::time::sleep(std::time::Duration::from_millis(200));
    tokio::pin!(window);
    loop {
        tokio::select! {
            () = &mut window => break,
            ev = rx.recv() => match ev {
                Ok((v, kind, obj)) if v > from => lines.push(json!({"type": kind, "object": obj}).to_string()),
                Ok(_) => {}
                Err(_) => break,
            }
        }
    }
    respond_lines(lines)
}

fn respond_lines(lines: Vec<String>) -> Response<Full<Bytes>> {
    let mut text = lines.join("\n");
    text.push('\n');
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(text)))
        .expect("response")
}
