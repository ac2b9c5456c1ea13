//! The SRP target: the login of RDMA channels ([`login`]) and each channel in its logged-in
//! state ([`channel`]), sans-IO.

pub mod channel;
pub mod driver;
pub mod local;
pub mod login;

pub use channel::{
    Channel, ChannelParams, Close, Core, Event, Payload, SrpTask, TaskCore, Transmit,
};
pub use driver::{Broken, Buffers, Driver};
pub use local::{ChannelCore, LocalChannel, LocalCore, LocalPolicy, VecBuffers};
pub use login::{
    port_id_for, Accepted, Admission, ChannelTable, ItNexusKey, Left, LoginPolicy, Logins,
    PortSettings, Refusal, DEFAULT_MAX_IT_IU_LEN, MAX_TI_IU_LEN, MIN_IMM_DATA_OFFSET,
    MIN_IT_IU_LEN,
};
