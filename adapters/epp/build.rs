//! Compiles the vendored ext_proc protos with protox (pure Rust: no protoc, nothing
//! downloaded) and generates the tonic server and client.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = "envoy/service/ext_proc/v3/external_processor.proto";
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile([root], ["proto"])?;
    tonic_prost_build::configure().build_server(true).build_client(true).compile_fds(fds)?;
    Ok(())
}
