//! Compiles the CSI spec's proto (vendored in `proto/`) without protoc: protox parses it in
//! Rust, tonic-prost-build generates the messages and the gRPC services.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/csi.proto");
    let descriptors = protox::compile(["csi.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .generate_default_stubs(true)
        .compile_fds(descriptors)?;
    Ok(())
}
