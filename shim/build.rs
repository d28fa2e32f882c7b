//! Link options of libtessera.so.

fn main() {
    // The hooks' own references to the library's exported functions (the tables `dlsym` and
    // `cuGetProcAddress` answer from, about 80) are bound at link time instead of looked up in
    // the process's global scope by the loader at every `exec`: each was a symbol look-up across
    // the loaded objects (R_X86_64_64 against the export), now a relative relocation. The
    // preloaded library comes first in that scope after the program itself, so those look-ups
    // found our own definitions unless the program defined a driver function of its own name,
    // when the tables would have handed out the program's function as our hook. The library
    // exports functions only (the hooks, `dlsym`, `dlvsym`), so `-Bsymbolic` binds what
    // `-Bsymbolic-functions` would (which zig's linker, the shipped glibc 2.17 build's, refuses).
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
    println!("cargo:rerun-if-changed=build.rs");
}
