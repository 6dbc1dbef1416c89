//! The protobuf types and gRPC stubs of Envoy's external processing protocol, generated
//! at build time from the protos vendored in `proto/` (see `build.rs`).
//!
//! The modules follow the protobuf packages, because the generated code names its
//! neighbours by relative paths.
#![allow(missing_docs, clippy::all, clippy::pedantic)]

/// Envoy's API packages.
pub mod envoy {
    /// `envoy.config.*`
    pub mod config {
        /// `envoy.config.core.*`
        pub mod core {
            /// `envoy.config.core.v3`: headers and metadata.
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
    /// `envoy.type.*`
    pub mod r#type {
        /// `envoy.type.v3`: the HTTP status.
        pub mod v3 {
            tonic::include_proto!("envoy.r#type.v3");
        }
    }
    /// `envoy.extensions.*`
    pub mod extensions {
        /// `envoy.extensions.filters.*`
        pub mod filters {
            /// `envoy.extensions.filters.http.*`
            pub mod http {
                /// `envoy.extensions.filters.http.ext_proc.*`
                pub mod ext_proc {
                    /// `envoy.extensions.filters.http.ext_proc.v3`: processing modes.
                    pub mod v3 {
                        tonic::include_proto!("envoy.extensions.filters.http.ext_proc.v3");
                    }
                }
            }
        }
    }
    /// `envoy.service.*`
    pub mod service {
        /// `envoy.service.ext_proc.*`
        pub mod ext_proc {
            /// `envoy.service.ext_proc.v3`: the `ExternalProcessor` service.
            pub mod v3 {
                tonic::include_proto!("envoy.service.ext_proc.v3");
            }
        }
    }
}

pub use envoy::config::core::v3 as core_v3;
pub use envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
pub use envoy::service::ext_proc::v3 as ext_proc;
