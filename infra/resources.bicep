// The chat function app and what it reaches, in one resource group.
//
// One user-assigned managed identity does all the talking: to the storage account (the host's
// state and the deployment package), to Application Insights (Entra-authenticated ingestion), to
// Azure OpenAI (keyless) or to Key Vault (the OpenAI key). The storage account refuses shared keys
// and the Azure OpenAI account refuses API keys, so no account key or key-bearing connection string
// exists anywhere, and none is ever read here.

param location string
param tags object
param resourceToken string

@allowed([
  'azureOpenAI'
  'openAI'
])
param upstream string
param modelName string
param modelVersion string
param deploymentName string
param deploymentSku string
param deploymentCapacity int
param openAiLocation string
param azureOpenAiApiVersion string

@secure()
param openAiApiKey string
param openAiBaseUrl string
param principalId string
param principalType string
param maximumInstanceCount int
param instanceMemoryMB int
param httpPerInstanceConcurrency int
param totalTimeoutSeconds int
param firstTokenTimeoutSeconds int
param idleTimeoutSeconds int
param heartbeatSeconds int

var useAzureOpenAI = upstream == 'azureOpenAI'
var useKeyVault = upstream == 'openAI'
var deploymentContainerName = 'app-package'

// Built-in role definition ids (the same in every tenant).
var storageBlobDataOwnerRole = 'b7e6dc6d-f1e8-4753-8033-0f276bb0955b'
var monitoringMetricsPublisherRole = '3913510d-42f4-4e42-8a64-420c390055eb'
var cognitiveServicesOpenAIUserRole = '5e0bd9bd-7b93-4f28-af87-19fc36ad61bd'
var keyVaultSecretsUserRole = '4633458b-17de-408a-b874-0445c86b69e6'
var keyVaultSecretsOfficerRole = 'b86a8fe4-44ce-4948-aee5-eccb2c155cd7'

resource identity 'Microsoft.ManagedIdentity/userAssignedIdentities@2023-01-31' = {
  name: 'id-${resourceToken}'
  location: location
  tags: tags
}

// ---- Monitoring: Log Analytics + workspace-based Application Insights, Entra ingestion only ----

resource logAnalytics 'Microsoft.OperationalInsights/workspaces@2023-09-01' = {
  name: 'log-${resourceToken}'
  location: location
  tags: tags
  properties: {
    sku: {
      name: 'PerGB2018'
    }
    retentionInDays: 30
  }
}

resource appInsights 'Microsoft.Insights/components@2020-02-02' = {
  name: 'appi-${resourceToken}'
  location: location
  tags: tags
  kind: 'web'
  properties: {
    Application_Type: 'web'
    WorkspaceResourceId: logAnalytics.id
    // Telemetry is accepted only with an Entra token (APPLICATIONINSIGHTS_AUTHENTICATION_STRING below),
    // so the instrumentation key inside the connection string grants nothing.
    DisableLocalAuth: true
  }
}

resource appInsightsPublisher 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(appInsights.id, identity.id, monitoringMetricsPublisherRole)
  scope: appInsights
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', monitoringMetricsPublisherRole)
    principalId: identity.properties.principalId
    principalType: 'ServicePrincipal'
  }
}

// ---- Storage: host state (AzureWebJobsStorage) and the deployment package, identity access only ----

resource storage 'Microsoft.Storage/storageAccounts@2023-05-01' = {
  name: 'st${resourceToken}'
  location: location
  tags: tags
  kind: 'StorageV2'
  sku: {
    name: 'Standard_LRS'
  }
  properties: {
    allowSharedKeyAccess: false
    defaultToOAuthAuthentication: true
    allowBlobPublicAccess: false
    minimumTlsVersion: 'TLS1_2'
    supportsHttpsTrafficOnly: true
    publicNetworkAccess: 'Enabled'
  }
}

resource blobService 'Microsoft.Storage/storageAccounts/blobServices@2023-05-01' = {
  parent: storage
  name: 'default'
}

resource deploymentContainer 'Microsoft.Storage/storageAccounts/blobServices/containers@2023-05-01' = {
  parent: blobService
  name: deploymentContainerName
  properties: {
    publicAccess: 'None'
  }
}

resource storageBlobOwner 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(storage.id, identity.id, storageBlobDataOwnerRole)
  scope: storage
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', storageBlobDataOwnerRole)
    principalId: identity.properties.principalId
    principalType: 'ServicePrincipal'
  }
}

// ---- Upstream, mode azureOpenAI: an Azure OpenAI account that accepts Entra tokens only ----

resource openAi 'Microsoft.CognitiveServices/accounts@2024-10-01' = if (useAzureOpenAI) {
  name: 'oai-${resourceToken}'
  location: openAiLocation
  tags: tags
  kind: 'OpenAI'
  sku: {
    name: 'S0'
  }
  properties: {
    customSubDomainName: 'oai-${resourceToken}'
    publicNetworkAccess: 'Enabled'
    disableLocalAuth: true
  }
}

resource modelDeployment 'Microsoft.CognitiveServices/accounts/deployments@2024-10-01' = if (useAzureOpenAI) {
  parent: openAi
  name: deploymentName
  sku: {
    name: deploymentSku
    capacity: deploymentCapacity
  }
  properties: {
    model: {
      format: 'OpenAI'
      name: modelName
      version: modelVersion
    }
  }
}

resource openAiUser 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (useAzureOpenAI) {
  name: guid(resourceGroup().id, 'oai-${resourceToken}', identity.id, cognitiveServicesOpenAIUserRole)
  scope: openAi
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', cognitiveServicesOpenAIUserRole)
    principalId: identity.properties.principalId
    principalType: 'ServicePrincipal'
  }
}

// The person running azd may call the model too (e.g. the app run locally against it).
resource openAiUserForDeployer 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (useAzureOpenAI && !empty(principalId)) {
  name: guid(resourceGroup().id, 'oai-${resourceToken}', principalId, cognitiveServicesOpenAIUserRole)
  scope: openAi
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', cognitiveServicesOpenAIUserRole)
    principalId: principalId
    principalType: principalType
  }
}

// ---- Upstream, mode openAI: the API key as a Key Vault secret, read by the platform ----

resource keyVault 'Microsoft.KeyVault/vaults@2023-07-01' = if (useKeyVault) {
  name: 'kv-${resourceToken}'
  location: location
  tags: tags
  properties: {
    tenantId: subscription().tenantId
    sku: {
      family: 'A'
      name: 'standard'
    }
    enableRbacAuthorization: true
    enableSoftDelete: true
    softDeleteRetentionInDays: 7
    publicNetworkAccess: 'Enabled'
  }
}

resource openAiKeySecret 'Microsoft.KeyVault/vaults/secrets@2023-07-01' = if (useKeyVault) {
  parent: keyVault
  name: 'openai-api-key'
  properties: {
    value: openAiApiKey
    contentType: 'OpenAI API key'
  }
}

resource keyVaultSecretsUser 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (useKeyVault) {
  name: guid(resourceGroup().id, 'kv-${resourceToken}', identity.id, keyVaultSecretsUserRole)
  scope: keyVault
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', keyVaultSecretsUserRole)
    principalId: identity.properties.principalId
    principalType: 'ServicePrincipal'
  }
}

// The person running azd may replace the key later (az keyvault secret set).
resource keyVaultOfficerForDeployer 'Microsoft.Authorization/roleAssignments@2022-04-01' = if (useKeyVault && !empty(principalId)) {
  name: guid(resourceGroup().id, 'kv-${resourceToken}', principalId, keyVaultSecretsOfficerRole)
  scope: keyVault
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', keyVaultSecretsOfficerRole)
    principalId: principalId
    principalType: principalType
  }
}

// ---- The function app: Flex Consumption, Python 3.13 ----

resource plan 'Microsoft.Web/serverfarms@2024-04-01' = {
  name: 'plan-${resourceToken}'
  location: location
  tags: tags
  kind: 'functionapp'
  sku: {
    name: 'FC1'
    tier: 'FlexConsumption'
  }
  properties: {
    reserved: true
  }
}

// Settings every mode gets. The host reaches storage and Application Insights with the identity;
// AZURE_CLIENT_ID makes DefaultAzureCredential in the app pick that same identity.
var commonSettings = [
  {
    name: 'AzureWebJobsStorage__accountName'
    value: storage.name
  }
  {
    name: 'AzureWebJobsStorage__credential'
    value: 'managedidentity'
  }
  {
    name: 'AzureWebJobsStorage__clientId'
    value: identity.properties.clientId
  }
  {
    name: 'APPLICATIONINSIGHTS_CONNECTION_STRING'
    value: appInsights.properties.ConnectionString
  }
  {
    name: 'APPLICATIONINSIGHTS_AUTHENTICATION_STRING'
    value: 'ClientId=${identity.properties.clientId};Authorization=AAD'
  }
  {
    // The Python worker configures azure-monitor-opentelemetry itself (host.json telemetryMode
    // OpenTelemetry); chatstream/telemetry.py then only adds its spans and metrics.
    name: 'PYTHON_APPLICATIONINSIGHTS_ENABLE_TELEMETRY'
    value: 'true'
  }
  {
    // Keep every span: azure-monitor-opentelemetry otherwise samples traces at 5 per second, and
    // each stream is one chat.stream span (docs/observability.md).
    name: 'OTEL_TRACES_SAMPLER'
    value: 'always_on'
  }
  {
    name: 'AZURE_CLIENT_ID'
    value: identity.properties.clientId
  }
  {
    name: 'OPENAI_MODEL'
    value: useAzureOpenAI ? deploymentName : modelName
  }
  {
    name: 'UPSTREAM_CONNECT_TIMEOUT_SECONDS'
    value: '10'
  }
  {
    name: 'FIRST_TOKEN_TIMEOUT_SECONDS'
    value: string(firstTokenTimeoutSeconds)
  }
  {
    name: 'IDLE_TIMEOUT_SECONDS'
    value: string(idleTimeoutSeconds)
  }
  {
    name: 'TOTAL_TIMEOUT_SECONDS'
    value: string(totalTimeoutSeconds)
  }
  {
    name: 'HEARTBEAT_SECONDS'
    value: string(heartbeatSeconds)
  }
  {
    name: 'USAGE_WAIT_SECONDS'
    value: '2'
  }
  {
    name: 'UPSTREAM_MAX_RETRIES'
    value: '2'
  }
  {
    name: 'MAX_BODY_BYTES'
    value: '1048576'
  }
  {
    // The browser playground (GET /api/playground) stays off in Azure; 'true' serves it there
    // (docs/playground.md). Every API call it makes still needs the function key.
    name: 'PLAYGROUND_ENABLED'
    value: 'false'
  }
]

var azureOpenAISettings = [
  {
    name: 'AZURE_OPENAI_ENDPOINT'
    value: useAzureOpenAI ? openAi.properties.endpoint : ''
  }
  {
    name: 'AZURE_OPENAI_DEPLOYMENT'
    value: deploymentName
  }
  {
    name: 'AZURE_OPENAI_API_VERSION'
    value: azureOpenAiApiVersion
  }
]

// The value is a Key Vault reference: the platform resolves it with keyVaultReferenceIdentity,
// and neither this template nor the site configuration ever holds the key itself.
var openAISettings = concat([
  {
    name: 'OPENAI_API_KEY'
    value: useKeyVault ? '@Microsoft.KeyVault(SecretUri=${openAiKeySecret.properties.secretUri})' : ''
  }
], empty(openAiBaseUrl) ? [] : [
  {
    name: 'OPENAI_BASE_URL'
    value: openAiBaseUrl
  }
])

resource functionApp 'Microsoft.Web/sites@2024-04-01' = {
  name: 'func-${resourceToken}'
  location: location
  tags: union(tags, {
    'azd-service-name': 'api'
  })
  kind: 'functionapp,linux'
  identity: {
    type: 'UserAssigned'
    userAssignedIdentities: {
      '${identity.id}': {}
    }
  }
  properties: {
    serverFarmId: plan.id
    httpsOnly: true
    keyVaultReferenceIdentity: identity.id
    siteConfig: {
      minTlsVersion: '1.2'
      scmMinTlsVersion: '1.2'
      appSettings: concat(commonSettings, useAzureOpenAI ? azureOpenAISettings : openAISettings)
    }
    functionAppConfig: {
      deployment: {
        storage: {
          type: 'blobContainer'
          value: '${storage.properties.primaryEndpoints.blob}${deploymentContainerName}'
          authentication: {
            type: 'UserAssignedIdentity'
            userAssignedIdentityResourceId: identity.id
          }
        }
      }
      scaleAndConcurrency: {
        maximumInstanceCount: maximumInstanceCount
        instanceMemoryMB: instanceMemoryMB
        triggers: {
          http: {
            perInstanceConcurrency: httpPerInstanceConcurrency
          }
        }
      }
      runtime: {
        name: 'python'
        version: '3.13'
      }
    }
  }
  // The host must be able to reach its storage and its upstream when it first starts.
  dependsOn: [
    storageBlobOwner
    appInsightsPublisher
    openAiUser
    keyVaultSecretsUser
    deploymentContainer
  ]
}

// No basic-auth publishing: deployments (azd, Core Tools) use Entra tokens. (siteConfig.ftpsState is
// not set: Flex Consumption does not support FTPS and lists the property as deprecated.)
resource ftpBasicAuth 'Microsoft.Web/sites/basicPublishingCredentialsPolicies@2024-04-01' = {
  parent: functionApp
  name: 'ftp'
  properties: {
    allow: false
  }
}

resource scmBasicAuth 'Microsoft.Web/sites/basicPublishingCredentialsPolicies@2024-04-01' = {
  parent: functionApp
  name: 'scm'
  properties: {
    allow: false
  }
}

output functionAppName string = functionApp.name
output chatUrl string = 'https://${functionApp.properties.defaultHostName}/api/chat'
output azureOpenAiEndpoint string = useAzureOpenAI ? openAi.properties.endpoint : ''
output azureOpenAiDeployment string = useAzureOpenAI ? deploymentName : ''
output keyVaultName string = useKeyVault ? keyVault.name : ''
output applicationInsightsName string = appInsights.name
output identityClientId string = identity.properties.clientId
